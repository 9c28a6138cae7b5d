"""vLLM through its own OpenAI server, run as a child process: chat (tools, JSON schema) and completions.

The server runs under its own interpreter, because vLLM pins a torch build that rarely matches the worker's: a
worker keeps it in a separate venv. Which one: `params["python"]`, else `find_vllm_python()` (`CODERAI_VLLM_PYTHON`,
else the venv `scripts/setup` links as `vllm/` inside this interpreter's venv), else this interpreter.
The engine translates jobs to OpenAI requests on loopback; vLLM batches concurrent requests itself, so the
engine keeps no lock. A server that dies is restarted (child_server's supervisor, `crash_limit` deaths within
`crash_window_s` park it). Streaming reads the server's SSE and stops on cancel: closing the response drops the
connection, and vLLM aborts a request whose client went away, freeing its KV cache. A whole (non-streamed)
answer is one blocking request, so cancel cannot cut it short.

Model params: `dtype`, `max_model_len`, `gpu_memory_utilization`, `tensor_parallel_size` and any other key
become `--kebab-case value` server flags (`True` a bare flag); `extra_args` is a list appended as is; `env` a
dict added to the server's environment; `python` and `load_timeout_s` (default 600) are the engine's own.
With `params.base` (a fine-tuned model, docs/finetuning.md), `path` is a peft LoRA adapter (the job's tar, or a
folder) and `base` the model folder. When this worker already runs a vLLM server of that base with LoRA on (a base
model with `params.enable_lora`, or another fine-tuned model of it), the adapter is loaded into that server at run
time (`/v1/load_lora_adapter`; unloaded when the model is) and answers to this model's name there: no second
server. Otherwise the engine starts a server of its own, the base with `--enable-lora` and the adapter, and later
fine-tuned models of the same base load into it. A server whose engine closes while adapters ride on it takes them
down with it (each is reported failed and re-placed, then starts a server of its own); one that restarts loads
them again before they take jobs.

A request whose prompt cache is scoped to its key (ChatJob.cache_scope) carries it as vLLM's `cache_salt` (vLLM 0.9
and later): its prefix-cache blocks are then hashed with the salt, so one key never hits another's cached prefix.

The server publishes its KV-cache events to the worker (kv_events.py; `params.kv_events = false` turns it off, and
it is off where the worker's interpreter has no pyzmq): a request carries its id as vLLM's `session_id`, and the
heartbeat says which affinity keys' prompts the cache dropped (`evicted`), which the router then forgets.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import httpx

from coderai.contracts import ChatJob, CompletionJob
from coderai.engine_worker.engines.base import EngineLoadError, visible_devices
from coderai.engine_worker.engines.hf_chat import unpack_adapter
from coderai.engine_worker.engines.kv_events import KvEvents
from coderai.engine_worker.engines.openai_server import OpenAIServerEngine, param_flags
from coderai.engine_worker.engines.server_load import LoadPoll, read_vllm

log = logging.getLogger("coderai.engine_worker")

OWN_PARAMS = frozenset(
    {
        "python",
        "load_timeout_s",
        "extra_args",
        "env",
        "ray_port",
        "ray_join_timeout_s",
        "crash_limit",
        "crash_window_s",
        "base",
        "kv_events",
    }
)
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM takes
RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # /v1/load_lora_adapter and unload answer
ADAPTER_CALL_TIMEOUT_S = 120.0  # loading an adapter reads its weights
# how often the server's load is read: once a heartbeat (every 2 s), which is what carries it. A scrape of vLLM's
# /metrics (~46 KB of text) costs its API server ~6 ms of CPU on the event loop its requests share
LOAD_POLL_S = 2.0
DEFAULT_BATCH = 256  # vLLM's max_num_seqs for its OpenAI server unless set (1,024 on the largest GPUs)

_lora_servers: dict[str, VllmEngine] = {}  # a base folder (resolved) -> the engine whose server runs it, LoRA on
_lora_servers_lock = threading.Lock()


def _base_key(path: str) -> str:
    return str(Path(os.path.expanduser(path)).resolve())


def find_vllm_python() -> str | None:
    """The interpreter of a venv of vLLM's own: `CODERAI_VLLM_PYTHON`, else `<this venv>/vllm/bin/python` (where
    `scripts/setup` links the one it makes), else None. A worker offers the vllm family when there is one."""
    named = os.environ.get("CODERAI_VLLM_PYTHON")
    if named:
        return named
    beside = Path(sys.prefix) / "vllm" / "bin" / "python"
    return str(beside) if beside.exists() else None


def server_command(python: str, model_path: str, name: str, port: int, params: dict[str, Any]) -> list[str]:
    """The argv that starts vLLM's OpenAI server for one model on loopback."""
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        name,
        # usage then says how many prompt tokens came from the prefix cache: the heartbeat's cache counters
        "--enable-prompt-tokens-details",
    ]
    return cmd + param_flags(params, OWN_PARAMS)


def lora_flags(name: str, adapter: Path) -> list[str]:
    """vLLM's flags serving the peft adapter folder `adapter` as model `name` (a request naming `name` runs the
    base with it), at the smallest rank vLLM takes that holds the adapter's."""
    try:
        rank = int(json.loads((adapter / "adapter_config.json").read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineLoadError(f"{adapter} is not a peft LoRA adapter (its adapter_config.json: {exc})") from None
    fits = [r for r in LORA_RANKS if r >= rank]
    if not fits:
        raise EngineLoadError(f"the adapter's rank {rank} is over vLLM's largest, {LORA_RANKS[-1]}")
    module = json.dumps({"name": name, "path": str(adapter)})
    return ["--enable-lora", "--max-lora-rank", str(fits[0]), "--lora-modules", module]


class VllmEngine(OpenAIServerEngine):
    """One model served by a vLLM OpenAI server that this engine starts, owns and stops."""

    family = "vllm"
    label = "vLLM"
    key_env = "VLLM_API_KEY"  # vLLM guards its /v1 routes with it; /health stays open
    max_concurrency = 64  # jobs a worker may run on this engine at once, from as many threads: vLLM batches them
    load_poll: LoadPoll | None = None  # its requests running and waiting and its KV share, for the heartbeat

    server: VllmEngine | None = None  # the engine whose server this adapter rides on, if not its own
    kv: KvEvents | None = None  # its server's KV-cache events (kv_events.py), when it publishes them

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.riders: dict[str, tuple[VllmEngine, Path]] = {}  # adapters loaded into this server at run time
        self._riders_lock = threading.Lock()
        self._closed = False

    @property
    def base_key(self) -> str:
        """The base folder this engine's server runs (a fine-tuned model's `base`, else its path), resolved."""
        return _base_key(self.config.param_str("base") or self.config.path)

    @property
    def lora_on(self) -> bool:
        return bool(self.config.param_str("base")) or self.config.param_bool("enable_lora")

    def load(self) -> None:
        if self.config.param_str("base"):
            with _lora_servers_lock:
                server = _lora_servers.get(self.base_key)
            try:
                if server is not None and server.adopt(self):
                    log.info("%s: its adapter rides on the vLLM server of %s", self.config.name, server.config.name)
                    return
            except EngineLoadError as exc:  # say a rank over the server's --max-lora-rank: a server of its own
                log.info("%s: not loaded into its base's server (%s); starting its own", self.config.name, exc)
        if self.kv is None and self.config.param_bool("kv_events", True) and KvEvents.available():
            # one endpoint for the engine's life (a restarted server publishes on it again), subscribed before the
            # server starts: a PUB socket drops what it sends before a subscription has reached it, so one made
            # once the server answers would miss the first requests' blocks (a flaky test showed it)
            self.kv = KvEvents()
            self.kv.start()
        try:
            super().load()
        except BaseException:
            if self.kv is not None:
                self.kv.stop()
                self.kv = None
            raise
        # the supervisor restarts a server that dies (the engine is reported failed meanwhile, a request it was
        # answering goes to another copy); it starts every later server, which then dies with it
        self.supervise()
        self.load_poll = LoadPoll(self.child, read_vllm, poll_s=LOAD_POLL_S)
        if self.lora_on:
            with _lora_servers_lock:
                _lora_servers.setdefault(self.base_key, self)

    def adopt(self, rider: VllmEngine) -> bool:
        """Load `rider`'s adapter into this server under `rider`'s name and connect `rider` to it; False when this
        server is going (`rider` then starts its own). EngineLoadError if vLLM refuses the adapter."""
        adapter = unpack_adapter(Path(os.path.expanduser(rider.config.path)))
        with self._riders_lock:
            if self._closed or self.client is None:
                return False
            self.riders[rider.config.name] = (rider, adapter)
        try:
            self._adapter_call("/v1/load_lora_adapter", {"lora_name": rider.config.name, "lora_path": str(adapter)})
        except EngineLoadError:
            with self._riders_lock:
                self.riders.pop(rider.config.name, None)
            raise
        rider.server = self
        rider.connect()
        return True

    def _adapter_call(self, path: str, body: dict[str, str]) -> None:
        try:
            r = httpx.post(
                f"{self.child.base_url}{path}", json=body, headers=self.auth_headers(), timeout=ADAPTER_CALL_TIMEOUT_S
            )
        except httpx.HTTPError as exc:
            raise EngineLoadError(f"vLLM did not answer {path} ({exc})") from None
        if r.status_code != 200:
            raise EngineLoadError(f"vLLM refused {path} for {body['lora_name']}: {r.status_code} {r.text[:500]}")

    @property
    def base_url(self) -> str:
        return self.server.base_url if self.server is not None else super().base_url

    def connect(self) -> None:
        server = self.server
        if server is None:
            return super().connect()
        self.connect_to(server.child, server.auth_headers())  # the adapter's name, on the server it rides on

    def auth_headers(self) -> dict[str, str]:
        return self.server.auth_headers() if self.server is not None else super().auth_headers()

    def _lost(self, why: str) -> None:
        super()._lost(why)
        for rider, _ in self._rider_list():
            rider._lost(why)

    def _restarted(self) -> None:
        """A new server: the adapters loaded at run time are loaded again before any of them takes jobs. Its cache
        starts empty: every conversation the old one held is lost."""
        if self.kv is not None:
            self.kv.book.cleared()
        self.connect()
        for rider, adapter in self._rider_list():
            try:
                self._adapter_call("/v1/load_lora_adapter", {"lora_name": rider.config.name, "lora_path": str(adapter)})
            except EngineLoadError as exc:
                log.error("%s: its adapter could not be loaded again after a restart: %s", rider.config.name, exc)
                continue
            rider.connect()
            if rider.on_back is not None:
                rider.on_back()
        if self.on_back is not None:
            self.on_back()

    def _rider_list(self) -> list[tuple[VllmEngine, Path]]:
        with self._riders_lock:
            return list(self.riders.values())

    def stats(self) -> dict[str, Any]:
        poll = self.load_poll if self.server is None else self.server.load_poll
        out = {**super().stats(), **poll.load.stats()} if poll is not None else super().stats()
        # the requests its server batches (max_num_seqs): the router's slots, so a warm conversation is not passed
        # over while the batch has room (a server reporting none read as one slot, and a load of 5 moved it)
        server = self.server or self
        out["slots"] = server.config.param_int("max_num_seqs") or DEFAULT_BATCH
        kv = self._kv()
        evicted = kv.book.drain(self.config.name) if kv is not None else []
        return {**out, "evicted": evicted} if evicted else out

    def _kv(self) -> KvEvents | None:
        """The KV events of the server this engine's requests run on (its own, or the one its adapter rides on)."""
        return self.server.kv if self.server is not None else self.kv

    def close(self) -> None:
        server, self.server = self.server, None
        if server is not None:  # an adapter riding on another engine's server: unload it there
            with server._riders_lock:
                server.riders.pop(self.config.name, None)
            try:
                server._adapter_call("/v1/unload_lora_adapter", {"lora_name": self.config.name})
            except EngineLoadError as exc:  # the server went meanwhile: nothing is left to unload
                log.info("%s: %s", self.config.name, exc)
            if self.client is not None:
                self.client.close()
                self.client = None
            return
        with _lora_servers_lock:
            if _lora_servers.get(self.base_key) is self:
                del _lora_servers[self.base_key]
        with self._riders_lock:
            self._closed = True
            riders, self.riders = list(self.riders.values()), {}
        for rider, _ in riders:  # their server goes with this engine: each is re-placed, then starts its own
            rider.server = None
            rider._lost(f"the vLLM server it rode on ({self.config.name}) was unloaded")
        if self.load_poll is not None:
            self.load_poll.stop()
        super().close()
        if self.kv is not None:
            self.kv.stop()

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        params = dict(self.config.params)
        python = self.config.param_str("python") or find_vllm_python() or sys.executable
        base, name = self.config.param_str("base"), self.config.name
        if base:  # a fine-tuned model: the base served with the adapter, which answers to this model's name
            params = {k: v for k, v in params.items() if k not in ("enable_lora", "max_lora_rank")}
            cmd = server_command(python, os.path.expanduser(base), f"{name}#base", port, params)
            cmd += lora_flags(name, unpack_adapter(Path(os.path.expanduser(self.config.path))))
        else:
            cmd = server_command(python, os.path.expanduser(self.config.path), name, port, params)
        if self.kv is not None:  # made and subscribed in `load`
            cmd += ["--kv-events-config", self.kv.config()]
        return cmd, {
            **os.environ,
            **visible_devices(self.config),
            **(RUNTIME_LORA_ENV if self.lora_on else {}),
            **{k: str(v) for k, v in self.config.param_table("env").items()},
        }

    def chat_body(self, job: ChatJob, stream: bool) -> dict[str, Any]:
        return self._cached(job, super().chat_body(job, stream))

    def completion_body(self, job: CompletionJob, stream: bool) -> dict[str, Any]:
        return self._cached(job, super().completion_body(job, stream))

    def _cached(self, job: ChatJob | CompletionJob, body: dict[str, Any]) -> dict[str, Any]:
        """The job's cache scope as vLLM's `cache_salt`; with KV events on, its request id as vLLM's `session_id`
        (which its cache events carry), and its affinity keys noted as what the blocks it stores will hold."""
        if job.cache_scope:
            body["cache_salt"] = job.cache_scope
        kv = self._kv()
        if kv is not None and job.cache_keys:
            body["session_id"] = job.request_id
            kv.book.began(job.request_id, self.config.name, job.cache_keys)
        return body
