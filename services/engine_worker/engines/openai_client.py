"""Our chat and completion jobs as requests to any OpenAI-compatible server, its answers and streams relayed back.

The client knows a base URL and nothing of who runs the server: a child of this worker (openai_server), or an
endpoint elsewhere. The server batches concurrent requests itself, so the client keeps no lock: each engine thread
has its own kept connection (loopback_http). Streaming reads the server's SSE and stops on cancel: closing the
response drops the connection, and the server aborts a request whose client went away, freeing its slot or KV
cache at once. A whole (non-streamed) answer is one blocking request, so cancel cannot cut it short.

`base_url` is the server's root (`http://127.0.0.1:8080`, `https://host/prefix`): the paths sent start with `/v1`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import msgspec

from coderai.contracts import ChatJob, Choice, CompletionJob, Usage
from coderai.engine_worker.engines.base import CancelFlag, EngineLost
from coderai.engine_worker.engines.child_server import EXITED
from coderai.engine_worker.engines.loopback_http import IDLE_S, Answer, LoopbackClient, TransportError
from coderai.engine_worker.engines.openai_wire import (
    Assembly,
    choice_logprobs,
    chat_request,
    completion_request,
    error_body,
    finish_reason,
    merged_usage,
    raise_error,
    sse_events,
    usage_of,
)

Emit = Callable[..., None]
"""emit(chat_delta, text_piece, finish_reason, logprobs=None, index=0)"""
Piece = Callable[[dict], tuple[dict | None, str | None]]

_enc = msgspec.json.Encoder()


class PromptCounters:
    """Prompt tokens, those the server had cached, and requests that hit its cache, from the answers' usage. The
    engine keeps one across the clients it makes (a restarted server gets a new client)."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prefix_hits = 0

    def add(self, usage: dict[str, Any] | None) -> None:
        if not usage:
            return
        self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        self.cached_tokens += cached
        self.prefix_hits += cached > 0

    def stats(self) -> dict[str, Any]:
        """The heartbeat's cache counters (no I/O: it reads them on the event loop)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefix_hits": self.prefix_hits,
            "cache_bytes": 0,
        }


def _chat_piece(c: dict[str, Any]) -> tuple[dict | None, str | None]:
    return {k: v for k, v in (c.get("delta") or {}).items() if v not in (None, "")} or None, None


def _chat_whole(c: dict[str, Any]) -> Choice:
    msg = {k: v for k, v in c["message"].items() if v is not None}
    return Choice(
        index=c.get("index", 0),
        message=msg,
        finish_reason=finish_reason(c.get("finish_reason")),
        logprobs=choice_logprobs(c),
    )


def _text_piece(c: dict[str, Any]) -> tuple[dict | None, str | None]:
    return None, c.get("text") or None


def _text_whole(c: dict[str, Any]) -> Choice:
    return Choice(
        index=c.get("index", 0),
        text=c.get("text") or "",
        finish_reason=finish_reason(c.get("finish_reason")),
        logprobs=choice_logprobs(c),
    )


class OpenAIClient:
    """Jobs as requests to one OpenAI-compatible server at `base_url`, answering as the model named `model`."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        headers: dict[str, str] | None = None,
        label: str = "the server",
        counters: PromptCounters | None = None,
        state: Callable[[], str] | None = None,
        connect_timeout_s: float = 30.0,
        read_timeout_s: float | None = None,
        max_body: int = 0,
        idle_s: float = IDLE_S,
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) base URL: {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.label = label
        self.counters = counters if counters is not None else PromptCounters()
        self.state = state  # what to add to "unreachable" (whether a child server still runs)
        self.prefix = url.path.rstrip("/")
        tls = url.scheme == "https"
        # no read timeout unless given: a long generation is silent until it ends; cancel cuts a stream short
        self.http = LoopbackClient(
            url.hostname,
            url.port or (443 if tls else 80),
            connect_timeout_s,
            headers=headers,
            tls=tls,
            read_timeout_s=read_timeout_s,
            max_body=max_body,
            idle_s=idle_s,
        )

    def close(self) -> None:
        self.http.close()

    def chat(
        self, job: ChatJob, cancel: CancelFlag, emit: Emit | None, body: dict[str, Any] | None = None
    ) -> tuple[list[Choice], Usage]:
        """A chat completion: whole choices, or streamed deltas through `emit` (then no choices). `body` is the
        request when the caller made its own (chat_request's, with what its server takes beyond OpenAI)."""
        body = body if body is not None else chat_request(self.model, job, emit is not None)
        return self._run("/v1/chat/completions", body, job.request_id, cancel, emit, _chat_piece, _chat_whole)

    def complete(
        self, job: CompletionJob, cancel: CancelFlag, emit: Emit | None, body: dict[str, Any] | None = None
    ) -> tuple[list[Choice], Usage]:
        """A text completion: whole choices, or streamed text through `emit` (then no choices)."""
        body = body if body is not None else completion_request(self.model, job, emit is not None)
        return self._run("/v1/completions", body, job.request_id, cancel, emit, _text_piece, _text_whole)

    def post(self, path: str, data: bytes, headers: dict[str, str] | None = None, keep: bool = True) -> Answer:
        """One request as is (a server's own routes: llama-server's `/slots`); transport errors as they come."""
        return self.http.post(self.prefix + path, data, headers or {}, keep)

    def post_json(self, path: str, body: dict[str, Any], request_id: str) -> Any:
        """One whole answer of the server, decoded; its error answer as the worker's errors."""
        try:  # the request id in a header: the server's logs and aborts then name the request as we do
            r = self.post(path, _enc.encode(body), {"X-Request-Id": request_id})
        except TransportError as exc:
            raise self._unreachable(exc) from exc
        if r.status != 200:
            raise_error(error_body(r.body), r.status, self.label)
        return msgspec.json.decode(r.body)

    def _unreachable(self, exc: Exception) -> RuntimeError:
        state = self.state() if self.state is not None else ""
        message = f"{self.label} unreachable ({exc})" + (f"; {state}" if state else "")
        # its child server died under the request (killed, crashed): another engine of the model may answer it, so
        # the worker answers it retryable and the gateway fails over (before the first token)
        return EngineLost(message) if state == EXITED else RuntimeError(message)

    def _run(
        self,
        path: str,
        body: dict[str, Any],
        request_id: str,
        cancel: CancelFlag,
        emit: Emit | None,
        piece: Piece,
        whole: Callable[[dict], Choice],
    ) -> tuple[list[Choice], Usage]:
        if emit is None and ((body.get("n") or 1) > 1 or isinstance(body.get("prompt"), list)):
            # llama-server's whole answer over several choices counts the tokens of one of them: streamed, each
            # is counted, and the choices are put together here
            parts = Assembly(chat="messages" in body)
            usage = self._run(path, body, request_id, cancel, parts.add, piece, whole)[1]
            return parts.choices(), usage
        if emit is None:
            answer = self.post_json(path, body, request_id)
            self.counters.add(answer.get("usage"))
            return [whole(c) for c in answer["choices"]], usage_of(answer.get("usage"), answer.get("timings"))
        try:
            return [], self._stream(path, body, {"X-Request-Id": request_id}, cancel, emit, piece)
        except TransportError as exc:
            raise self._unreachable(exc) from exc

    def _stream(
        self, path: str, body: dict[str, Any], headers: dict[str, str], cancel: CancelFlag, emit: Emit, piece: Piece
    ) -> Usage:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        usages: list[dict[str, Any]] = []  # llama-server sends one per choice (n > 1, a list of prompts)
        timings: Any = None  # llama-server's, on its last events
        pieces = 0
        with self.http.stream(self.prefix + path, _enc.encode(body), headers, cancel) as (status, lines):
            if status != 200:
                raise_error(error_body(b"".join(lines)), status, self.label)
            for event in sse_events((line.decode("utf-8", "replace") for line in lines), cancel, self.label):
                if event.get("usage"):
                    usages.append(event["usage"])
                if event.get("timings"):
                    timings = event["timings"]
                for c in event.get("choices") or []:
                    delta, text = piece(c)
                    finish = c.get("finish_reason")
                    logprobs = choice_logprobs(c)
                    if delta or text or finish or logprobs:
                        pieces += bool(delta or text or logprobs)
                        extra: dict[str, Any] = {"index": c["index"]} if c.get("index") else {}
                        if logprobs:
                            extra["logprobs"] = logprobs
                        emit(delta, text, finish_reason(finish) if finish else None, **extra)
        # leaving the block closes the response; on cancel that is what tells the server to abort the request
        if not usages:  # cancelled before the usage event: one streamed piece is one token
            return Usage(completion_tokens=pieces, total_tokens=pieces)
        usage = merged_usage(usages, max(1, body.get("n") or 1))
        self.counters.add(usage)
        return usage_of(usage, timings if len(usages) == 1 else None)
