"""An engine that is an OpenAI-compatible server run as a child process on loopback (vLLM's, llama.cpp's).

Two parts: the child (child_server: spawn, health, restart, stop, its log) and the protocol (openai_client: jobs
as OpenAI requests to the child's URL, answers and streams back, cancel by dropping the connection). This engine
puts them together: the client follows the child to each new port, and the child's key is the client's.

Subclasses say how to start the server (`command`), what it is called in messages (`label`) and may override
`ready_path`, `chat_body` and `completion_body`. The worker calls `load` on the engine's own thread, which lives as
long as the engine: the child dies with it (see child_server).
"""

from __future__ import annotations

import secrets
import signal
import subprocess
from collections.abc import Callable
from typing import Any

import httpx

from coderai.contracts import ChatJob, Choice, CompletionJob, ModelConfig, Usage
from coderai.engine_worker.engines.base import CancelFlag, Engine
from coderai.engine_worker.engines.child_server import CRASH_LIMIT, CRASH_WINDOW_S, ChildServer
from coderai.engine_worker.engines.openai_client import Emit, OpenAIClient, PromptCounters
from coderai.engine_worker.engines.openai_wire import chat_request, completion_request

__all__ = ["Emit", "OpenAIServerEngine", "param_flags"]


def param_flags(params: dict[str, Any], own: frozenset[str]) -> list[str]:
    """A models-file entry's other params as server flags: `key = v` becomes `--key v` (underscores to dashes),
    `true` a bare flag, `false` or none nothing; then `extra_args` as given. Keys in `own` are the engine's."""
    out: list[str] = []
    for key, value in params.items():
        if key in own or value is None or value is False:
            continue
        out.append("--" + key.replace("_", "-"))
        if value is not True:
            out.append(str(value))
    return out + [str(a) for a in params.get("extra_args") or []]


class OpenAIServerEngine(Engine):
    """One model served by an OpenAI-compatible server that this engine starts, owns and stops."""

    label = "the server"
    ready_path = "/health"
    key_env = ""  # the environment variable the server reads its API key from (never argv: `ps` shows argv)
    death_signal = signal.SIGTERM  # what the server gets when the thread that started it dies (PR_SET_PDEATHSIG)
    max_concurrency = 64  # jobs a worker may run on this engine at once, from as many threads: the server batches
    streams_choices = prompt_lists = logit_bias = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        # the child's own API key: a local user who finds its loopback port cannot be answered (unbilled) by it;
        # only this engine knows the key, and a new one is made for each engine
        self.api_key = secrets.token_urlsafe(32)
        self.counters = PromptCounters()  # across restarts, each of which makes a new client
        self.client: OpenAIClient | None = None
        self.child = ChildServer(
            self._keyed_command,
            label=self.label,
            name=config.name,
            serving=config.path,
            ready_path=self.ready_path,
            death_signal=self.death_signal,
            headers=self.auth_headers(),
            log_name=self.family or "server",
            crash_limit=config.param_int("crash_limit") or CRASH_LIMIT,
            crash_window_s=config.param_float("crash_window_s") or CRASH_WINDOW_S,
        )

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.child.proc

    @property
    def base_url(self) -> str:
        return self.child.base_url

    @property
    def log_path(self) -> str:
        return self.child.log_path

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        """The argv and environment that start the server on 127.0.0.1:`port`."""
        raise NotImplementedError

    def _keyed_command(self, port: int) -> tuple[list[str], dict[str, str]]:
        cmd, env = self.command(port)
        return cmd, ({**env, self.key_env: self.api_key} if self.key_env else env)

    def auth_headers(self) -> dict[str, str]:
        """What every request to the child carries: its key, where the server takes one."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.key_env else {}

    def load_timeout_s(self) -> float:
        return self.config.param_float("load_timeout_s") or 600.0

    def load(self) -> None:
        """Start the server and wait for `ready_path`; fail with the server's log tail if it exits or times out."""
        self.start_server()

    def start_server(self, port: int | None = None) -> None:
        """Start the child (on a free port unless told) and a client for it; EngineLoadError with its log tail."""
        self.child.start_timeout_s = self.load_timeout_s()
        self.child.start(port)
        self.connect()

    def supervise(self, on_alive: Callable[[httpx.Client], None] | None = None) -> None:
        """Have the child restarted when it dies (`child_server`'s supervisor, which starts every later child,
        so each dies with it): the engine is reported lost meanwhile, so a request it was answering goes to
        another copy, and back once a new child answers; `on_alive(probe)` runs on every poll while it lives, after
        the client's connections idle too long are closed."""

        def alive(probe: httpx.Client) -> None:
            client = self.client
            if client is not None:
                client.http.prune()
            if on_alive is not None:
                on_alive(probe)

        self.child.supervise(on_alive=alive, on_exit=self._lost, on_restart=self._restarted)

    @property
    def restarts(self) -> int:
        return self.child.restarts

    def _lost(self, why: str) -> None:
        if self.on_lost is not None:
            self.on_lost(why)

    def _restarted(self) -> None:
        self.connect()
        if self.on_back is not None:
            self.on_back()

    def connect(self) -> None:
        """A client for the child where it listens now (after a restart, on another port)."""
        self.connect_to(self.child, self.auth_headers())

    def connect_to(self, child: ChildServer, headers: dict[str, str]) -> None:
        """A client for `child` (this engine's own, or a server it shares) with `headers` on every request."""
        old, self.client = (
            self.client,
            OpenAIClient(
                child.base_url,
                self.config.name,
                headers=headers,
                label=self.label,
                counters=self.counters,
                state=child.state,
            ),
        )
        if old is not None:
            old.close()

    def close(self) -> None:
        self.child.close()
        if self.client is not None:
            self.client.close()
            self.client = None

    def stats(self) -> dict[str, Any]:
        """Prompt counters from the answers' usage (no I/O: the heartbeat reads this on the event loop)."""
        return self.counters.stats()

    def chat_body(self, job: ChatJob, stream: bool) -> dict[str, Any]:
        return chat_request(self.config.name, job, stream)

    def completion_body(self, job: CompletionJob, stream: bool) -> dict[str, Any]:
        return completion_request(self.config.name, job, stream)

    def chat(self, job: ChatJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        """A chat completion: whole choices, or streamed deltas through `emit` (then no choices)."""
        body = self.chat_body(job, emit is not None)
        return self._client().chat(job, cancel, emit, body)

    def complete(self, job: CompletionJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        """A text completion: whole choices, or streamed text through `emit` (then no choices)."""
        body = self.completion_body(job, emit is not None)
        return self._client().complete(job, cancel, emit, body)

    def post_json(self, path: str, body: dict[str, Any], request_id: str) -> Any:
        """One whole answer of the server, decoded; its error answer as the worker's errors."""
        return self._client().post_json(path, body, request_id)

    def _client(self) -> OpenAIClient:
        client = self.client
        if client is None:
            raise RuntimeError(f"{self.label} is not loaded")
        return client
