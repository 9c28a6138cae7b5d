"""An engine that is an OpenAI-compatible server run as a child process on loopback (vLLM's, llama.cpp's).

The engine translates jobs to OpenAI requests; the server batches concurrent requests itself, so the engine
keeps no lock. Streaming reads the server's SSE and stops on cancel: closing the response drops the connection,
and the server aborts a request whose client went away, freeing its slot or KV cache at once. A whole
(non-streamed) answer is one blocking request, so cancel cannot cut it short.

Subclasses say how to start the server (`command`), what it is called in messages (`label`) and may override
`ready_path`. The child gets SIGTERM when the thread that started it dies (PR_SET_PDEATHSIG follows the forking
thread, not the process): the worker calls `load` on the engine's own thread, which lives as long as the engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec

from coderai.contracts import ChatJob, Choice, CompletionJob, ModelConfig, SamplingParams, Usage
from coderai.engine_worker.engines.base import BadInput, CancelFlag, Engine, EngineLoadError
from coderai.engine_worker.engines.loopback_http import LoopbackClient, TransportError
from coderai.runtime.embedded import die_with_parent

Emit = Callable[..., None]
"""emit(chat_delta, text_piece, finish_reason, logprobs=None, index=0)"""

LOG_TAIL_CHARS = 4000
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")


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


def _sampling(p: SamplingParams, stream: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if v is not None:
            out[name] = v
    if p.stop:
        out["stop"] = list(p.stop)
    if p.n != 1:
        out["n"] = p.n
    if p.logit_bias:
        out["logit_bias"] = p.logit_bias
    return out


def chat_request(model: str, job: ChatJob, stream: bool) -> dict[str, Any]:
    """The OpenAI `/v1/chat/completions` body for a chat job (its `options` too: reasoning_effort, ...)."""
    extras = {"tools": job.tools or None, "tool_choice": job.tool_choice, "response_format": job.response_format or None,
              **(job.options or {})}
    if job.params.logprobs:
        extras["logprobs"] = True
        extras["top_logprobs"] = job.params.top_logprobs
    return {"model": model, "messages": job.messages, **_sampling(job.params, stream),
            **{k: v for k, v in extras.items() if v is not None}}


def completion_request(model: str, job: CompletionJob, stream: bool) -> dict[str, Any]:
    """The OpenAI `/v1/completions` body for a completion job."""
    body: dict[str, Any] = {"model": model, "prompt": job.prompt, "max_tokens": 16,  # OpenAI's default
                            **_sampling(job.params, stream)}
    if job.params.logprobs:
        body["logprobs"] = job.params.top_logprobs or 0
    return {**body, "echo": True} if job.echo else body


def sse_events(lines: Iterator[str], cancel: CancelFlag, label: str = "the server") -> Iterator[dict[str, Any]]:
    """The JSON payloads of an SSE stream's `data:` lines, until `[DONE]` or until `cancel` is set."""
    for line in lines:
        if cancel:
            return
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if not isinstance(event, dict):  # llama-server opens a stream over a list of prompts with `null`
            continue
        if "error" in event:  # a failure after the stream began arrives as an event, not a status
            raise_error(event, 500, label)
        yield event
    if not cancel:  # the connection ended without the server's last word: it died or dropped us mid-answer
        raise RuntimeError(f"{label} ended the stream before [DONE]")


def raise_error(body: Any, status: int, label: str = "the server") -> None:
    """A server's error answer as the worker's errors: a 400 is the client's (BadInput, naming its param)."""
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else (body if isinstance(body, dict) else {})
    message = str(err.get("message") or body)
    code = err.get("code") or status
    # llama-server answers a conversation its chat template cannot take (a message, a tool call) with a 500
    # "Failed to parse messages": the client's input, not the server's failure
    unparsed = message.startswith("Failed to parse messages")
    if code == 400 or status == 400 or unparsed:
        raise BadInput(f"{label}: {message}", err.get("param") or ("messages" if unparsed else None))
    raise RuntimeError(f"{label} answered {code}: {message}")


def _finish(reason: str | None) -> Any:
    return reason if reason in FINISH_REASONS else "stop"


class Assembly:
    """Whole choices from a stream's pieces: content, reasoning and tool calls (by their index) put together."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.parts: dict[int, dict[str, Any]] = {}

    def add(self, delta: dict | None, text: str | None, finish: str | None, logprobs: dict | None = None,
            index: int = 0) -> None:
        c = self.parts.setdefault(index, {"message": {}, "text": "", "finish": None, "logprobs": None})
        if text:
            c["text"] += text
        msg = c["message"]
        for key, value in (delta or {}).items():
            if key == "tool_calls":
                calls = msg.setdefault("tool_calls", [])
                for t in value:
                    i = t.get("index", len(calls))
                    while len(calls) <= i:
                        calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                    if t.get("id"):
                        calls[i]["id"] = t["id"]
                    fn = t.get("function") or {}
                    calls[i]["function"]["name"] += fn.get("name") or ""
                    calls[i]["function"]["arguments"] += fn.get("arguments") or ""
            elif isinstance(value, str) and key != "role":
                msg[key] = msg.get(key, "") + value
        if logprobs:
            c["logprobs"] = _joined_logprobs(c["logprobs"], logprobs)
        if finish:
            c["finish"] = finish

    def choices(self) -> list[Choice]:
        out = []
        for i, c in sorted(self.parts.items()):
            if self.chat:
                out.append(Choice(index=i, message={"role": "assistant", "content": None, **c["message"]},
                                  finish_reason=c["finish"] or "stop", logprobs=c["logprobs"]))
            else:
                out.append(Choice(index=i, text=c["text"], finish_reason=c["finish"] or "stop", logprobs=c["logprobs"]))
        return out


def _logprobs(choice: dict[str, Any]) -> dict | None:
    """A choice's logprobs as OpenAI's schema has them: a chat choice's always name `refusal` (null here), which
    llama-server leaves out."""
    lp = choice.get("logprobs") or None
    if lp is not None and "content" in lp:
        lp.setdefault("refusal", None)
    return lp


def _joined_logprobs(have: dict | None, more: dict) -> dict:
    """Two pieces' logprobs as one: every list in them (chat's `content`, completions' `tokens`, ...) joined."""
    if have is None:
        return dict(more)
    return {k: (have.get(k) or []) + v if isinstance(v, list) else v for k, v in more.items()}


def _merged_usage(usages: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One usage of a stream whose server counted each choice apart: every completion token, and each prompt
    once (its `n` choices all counted it)."""
    if len(usages) == 1:
        return usages[0]

    def total(name: str, of: Callable[[dict], Any] = lambda u: u) -> int:
        return sum(int((of(u) or {}).get(name) or 0) for u in usages)

    return {"prompt_tokens": total("prompt_tokens") // n, "completion_tokens": total("completion_tokens"),
            "prompt_tokens_details": {"cached_tokens": total("cached_tokens", lambda u: u.get("prompt_tokens_details")) // n}}


def _usage(u: dict[str, Any] | None, timings: Any = None) -> Usage:
    """The server's usage; with llama-server's `timings`, how long it read the prompt and generated."""
    if not u:
        return Usage()
    p, c = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    details = u.get("prompt_tokens_details")
    cached = int((details.get("cached_tokens") if isinstance(details, dict) else 0) or 0)
    t = timings if isinstance(timings, dict) else {}
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c, cached_tokens=min(max(cached, 0), p),
                 prompt_ms=_ms(t.get("prompt_ms")), generate_ms=_ms(t.get("predicted_ms")))


def _ms(value: Any) -> float:
    """A duration the server reported, in ms: a finite, non-negative number, else 0 (unknown)."""
    return float(value) if isinstance(value, (int, float)) and 0 <= value < 1e12 else 0.0


_enc = msgspec.json.Encoder()


def _json_bytes(data: bytes) -> Any:
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError:
        return {"message": data[:2000].decode("utf-8", "replace")}


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
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.base_url = ""
        self.log_path = ""
        self.client: LoopbackClient | None = None
        # the child's own API key: a local user who finds its loopback port cannot be answered (unbilled) by it;
        # only this engine knows the key, and a new one is made for each engine
        self.api_key = secrets.token_urlsafe(32)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prefix_hits = 0

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        """The argv and environment that start the server on 127.0.0.1:`port`."""
        raise NotImplementedError

    def load_timeout_s(self) -> float:
        return float(self.config.params.get("load_timeout_s") or 600.0)

    def start_server(self, port: int, timeout_s: float) -> None:
        """Start the server and wait for `ready_path`; EngineLoadError with its log tail if it exits or times out."""
        cmd, env = self.command(port)
        if self.key_env:
            env = {**env, self.key_env: self.api_key}
        fd, self.log_path = tempfile.mkstemp(prefix=f"coderai-{self.family}-{port}-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            try:
                # a session of its own lets close() reach the server's own children too
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=env, start_new_session=True,
                                             preexec_fn=die_with_parent(self.death_signal))  # noqa: PLW1509
            except OSError as exc:
                raise EngineLoadError(f"cannot start {self.label} ({cmd[0]}): {exc}") from exc
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self._wait_healthy(timeout_s)
        if self.client is None:  # no read timeout: a long generation is silent until it ends; cancel cuts it short
            self.client = LoopbackClient("127.0.0.1", port, headers=self.auth_headers())

    def auth_headers(self) -> dict[str, str]:
        """What every request to the child carries: its key, where the server takes one."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.key_env else {}

    def _wait_healthy(self, timeout_s: float) -> None:
        proc = self.proc  # close() from another thread (a cancelled load) takes self.proc away and stops it
        assert proc is not None
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, headers=self.auth_headers()) as probe:
            while True:
                try:
                    if probe.get(f"{self.base_url}{self.ready_path}").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                left = deadline - time.monotonic()
                try:  # the poll interval doubles as exit detection
                    code = proc.wait(timeout=min(0.5, left)) if left > 0 else None
                except subprocess.TimeoutExpired:
                    continue
                why = f"exited with code {code}" if code is not None else f"was not healthy after {timeout_s:.0f} s"
                tail = self.log_tail()
                self.stop_server()
                raise EngineLoadError(f"{self.label} {why} while loading {self.config.path}; its log ends:\n{tail}")

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - chars))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def stop_server(self, grace_s: float = 30.0) -> None:
        """Stop the server and its children; SIGKILL whatever lingers."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the server's own children, should any outlive it
        if self.log_path:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)
            self.log_path = ""

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        self.stop_server()

    def stats(self) -> dict[str, Any]:
        """Prompt counters from the answers' usage (no I/O: the heartbeat reads this on the event loop)."""
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "prefix_hits": self.prefix_hits, "cache_bytes": 0}

    def _account(self, u: dict[str, Any] | None) -> None:
        if not u:
            return
        self.prompt_tokens += int(u.get("prompt_tokens") or 0)
        cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        self.cached_tokens += cached
        self.prefix_hits += cached > 0

    def chat_body(self, job: ChatJob, stream: bool) -> dict[str, Any]:
        return chat_request(self.config.name, job, stream)

    def completion_body(self, job: CompletionJob, stream: bool) -> dict[str, Any]:
        return completion_request(self.config.name, job, stream)

    def chat(self, job: ChatJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        """A chat completion: whole choices, or streamed deltas through `emit` (then no choices)."""
        def piece(c: dict[str, Any]) -> tuple[dict | None, str | None]:
            return {k: v for k, v in (c.get("delta") or {}).items() if v not in (None, "")} or None, None

        def whole(c: dict[str, Any]) -> Choice:
            msg = {k: v for k, v in c["message"].items() if v is not None}
            return Choice(index=c.get("index", 0), message=msg, finish_reason=_finish(c.get("finish_reason")),
                          logprobs=_logprobs(c))

        return self._run("/v1/chat/completions", self.chat_body(job, emit is not None), job.request_id, cancel, emit,
                         piece, whole)

    def complete(self, job: CompletionJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        """A text completion: whole choices, or streamed text through `emit` (then no choices)."""
        def piece(c: dict[str, Any]) -> tuple[dict | None, str | None]:
            return None, c.get("text") or None

        def whole(c: dict[str, Any]) -> Choice:
            return Choice(index=c.get("index", 0), text=c.get("text") or "", finish_reason=_finish(c.get("finish_reason")),
                          logprobs=_logprobs(c))

        return self._run("/v1/completions", self.completion_body(job, emit is not None), job.request_id, cancel, emit,
                         piece, whole)

    def _run(self, path: str, body: dict[str, Any], request_id: str, cancel: CancelFlag, emit: Emit | None,
             piece: Callable[[dict], tuple[dict | None, str | None]],
             whole: Callable[[dict], Choice]) -> tuple[list[Choice], Usage]:
        if emit is None and ((body.get("n") or 1) > 1 or isinstance(body.get("prompt"), list)):
            # llama-server's whole answer over several choices counts the tokens of one of them: streamed, each
            # is counted, and the choices are put together here
            parts = Assembly(chat="messages" in body)
            usage = self._run(path, body, request_id, cancel, parts.add, piece, whole)[1]
            return parts.choices(), usage
        if emit is None:
            answer = self.post_json(path, body, request_id)
            self._account(answer.get("usage"))
            return [whole(c) for c in answer["choices"]], _usage(answer.get("usage"), answer.get("timings"))
        if self.client is None:
            raise RuntimeError(f"{self.label} is not loaded")
        try:
            return [], self._stream(path, body, {"X-Request-Id": request_id}, cancel, emit, piece)
        except TransportError as exc:
            raise self._unreachable(exc) from exc

    def post_json(self, path: str, body: dict[str, Any], request_id: str) -> Any:
        """One whole answer of the server, decoded; its error answer as the worker's errors."""
        if self.client is None:
            raise RuntimeError(f"{self.label} is not loaded")
        try:  # the request id in a header: the server's logs and aborts then name the request as we do
            r = self.client.post(path, _enc.encode(body), {"X-Request-Id": request_id})
        except TransportError as exc:
            raise self._unreachable(exc) from exc
        if r.status != 200:
            raise_error(_json_bytes(r.body), r.status, self.label)
        return msgspec.json.decode(r.body)

    def _unreachable(self, exc: Exception) -> RuntimeError:
        state = "exited" if self.proc is None or self.proc.poll() is not None else "is running"
        return RuntimeError(f"{self.label} unreachable ({exc}); it {state}")

    def _stream(self, path: str, body: dict[str, Any], headers: dict[str, str], cancel: CancelFlag, emit: Emit,
                piece: Callable[[dict], tuple[dict | None, str | None]]) -> Usage:
        assert self.client is not None
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        usages: list[dict[str, Any]] = []  # llama-server sends one per choice (n > 1, a list of prompts)
        timings: Any = None  # llama-server's, on its last events
        pieces = 0
        with self.client.stream(path, _enc.encode(body), headers) as (status, lines):
            if status != 200:
                raise_error(_json_bytes(b"".join(lines)), status, self.label)
            for event in sse_events((line.decode("utf-8", "replace") for line in lines), cancel, self.label):
                if event.get("usage"):
                    usages.append(event["usage"])
                if event.get("timings"):
                    timings = event["timings"]
                for c in event.get("choices") or []:
                    delta, text = piece(c)
                    finish = c.get("finish_reason")
                    logprobs = _logprobs(c)
                    if delta or text or finish or logprobs:
                        pieces += bool(delta or text or logprobs)
                        extra: dict[str, Any] = {"index": c["index"]} if c.get("index") else {}
                        if logprobs:
                            extra["logprobs"] = logprobs
                        emit(delta, text, _finish(finish) if finish else None, **extra)
        # leaving the block closes the response; on cancel that is what tells the server to abort the request
        if not usages:  # cancelled before the usage event: one streamed piece is one token
            return Usage(completion_tokens=pieces, total_tokens=pieces)
        usage = _merged_usage(usages, max(1, body.get("n") or 1))
        self._account(usage)
        return _usage(usage, timings if len(usages) == 1 else None)
