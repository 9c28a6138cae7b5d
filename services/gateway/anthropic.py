"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), so the `anthropic` SDK and
Claude Code work against coderai's own models: the same pipeline and routing as `/v1/chat/completions`, answers
whole or streamed as Anthropic's server-sent events, errors in Anthropic's shape. The key comes as `x-api-key`
(auth.py takes it where no `Authorization` header is sent); `anthropic-version`, `anthropic-beta` (any value, unknown
betas included) and the beta route's `?beta=true` are accepted and not read: one shape is served."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.exceptions import HTTPException
from litestar.response import Stream

from coderai.contracts import Chunk, Final
from coderai.gateway import anthropic_types as wire
from coderai.gateway.errors import ApiError
from coderai.gateway.http import STREAM_HEADERS, json_response, new_request_id, read_json, until_disconnect
from coderai.gateway.openai.chat import chat_route
from coderai.gateway.pipeline import Call, answer, relay_stream
from coderai.gateway.seal import sealer
from coderai.gateway.state import InferenceController

CLAUDE_CODE_SESSION_HEADER = "X-Claude-Code-Session-Id"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_enc = msgspec.json.Encoder()


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object for an HTTP status: the OpenAI routes' status, Anthropic's type names."""
    kind = ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _api_error(_: Request, exc: ApiError) -> Response:
    return Response(
        content=_enc.encode(error_body(exc.status, exc.message)),
        status_code=exc.status,
        media_type="application/json",
        headers=exc.headers,
    )


def _http_error(_: Request, exc: HTTPException) -> Response:
    return Response(
        content=_enc.encode(error_body(exc.status_code, str(exc.detail))),
        status_code=exc.status_code,
        media_type="application/json",
        headers=getattr(exc, "headers", None) or {},
    )


def event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _enc.encode(data) + b"\n\n"


class Events:
    """One streamed message as Anthropic's events: `message_start` and a `ping` first, then a block per kind of
    delta (thinking, text, each tool call: `content_block_start`, deltas, `content_block_stop`), then
    `message_delta` (stop reason, usage) and `message_stop`. Renders the relay's frames (pipeline.relay_stream)."""

    __slots__ = ("rid", "model", "applied", "started", "index", "open", "thought", "tools", "finish")

    def __init__(self, rid: str, model: str, applied: list[dict[str, Any]] | None = None) -> None:
        self.rid, self.model, self.applied = rid, model, applied  # applied: the context edits, told at the end
        self.started = False
        self.index = -1  # the latest block's index
        self.open: Any = None  # what the open block holds: "thinking", "text" or ("tool", the call's index)
        self.thought = ""  # the open thinking block's text, signed when it closes
        self.tools: dict[int, int] = {}  # the engine's tool call index -> its block
        self.finish: str | None = None

    def _head(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        message = {
            "id": f"msg_{self.rid}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return event("message_start", {"type": "message_start", "message": message}) + event("ping", {"type": "ping"})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        out = b""
        if self.open == "thinking":  # as Anthropic streams it: the signature last, just before the block stops
            out = self._delta(self.index, {"type": "signature_delta", "signature": sealer().sign(self.thought)})
            self.thought = ""
        self.open = None
        return out + event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _start(self, holds: Any, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.index += 1
        self.open = holds
        return out + event(
            "content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block}
        )

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    def chunk(self, frame: Chunk) -> bytes:
        out = [self._head()]
        delta = frame.delta or {}
        if isinstance(thought := delta.get("reasoning_content"), str) and thought:
            if self.open != "thinking":
                out.append(self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""}))
            out.append(self._delta(self.index, {"type": "thinking_delta", "thinking": thought}))
            self.thought += thought
        if text := delta.get("content"):
            if self.open != "text":
                out.append(self._start("text", {"type": "text", "text": ""}))
            out.append(self._delta(self.index, {"type": "text_delta", "text": text}))
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            n = call.get("index", 0)
            fn = call.get("function") or {}
            if n not in self.tools:
                out.append(
                    self._start(
                        ("tool", n),
                        {
                            "type": "tool_use",
                            "id": wire.tool_use_id(call.get("id")),
                            "name": fn.get("name", ""),
                            "input": {},
                        },
                    )
                )
                self.tools[n] = self.index
            if fn.get("arguments"):
                out.append(self._delta(self.tools[n], {"type": "input_json_delta", "partial_json": fn["arguments"]}))
        if frame.finish_reason:
            self.finish = frame.finish_reason
        return b"".join(out)

    async def final(self, frame: Final) -> bytes:
        reason = wire.stop_reason(self.finish, bool(self.tools))
        return (
            self._head()
            + self._close()
            + event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": None},
                    "usage": wire.usage_json(frame.usage),
                    **({"context_management": {"applied_edits": self.applied}} if self.applied else {}),
                },
            )
            + event("message_stop", {"type": "message_stop"})
        )

    def error(self, err: ApiError) -> bytes:
        """An engine failure after the status line: Anthropic's `error` event, which the SDK raises."""
        return self._head() + event("error", error_body(err.status, err.message))


def _headers(call: Call) -> dict[str, str]:
    """coderai's headers, and the request id where the SDK reads it (`request-id`)."""
    return {**call.response_headers(), "request-id": call.request_id}


class AnthropicController(InferenceController):
    path = "/v1/messages"
    exception_handlers = {ApiError: _api_error, HTTPException: _http_error}

    @post("/", status_code=200)
    async def messages(self, request: Request) -> Response | Stream:
        who = self.caller(request)
        req = await read_json(request, wire.MessagesRequest)
        messages, applied = wire.context_edited(req)
        job = wire.chat_job(req, new_request_id(), messages)
        route = chat_route(
            request, who, job, wire.user_id(req), wire.session_id(req, request.headers.get(CLAUDE_CODE_SESSION_HEADER))
        )
        call = Call(self.gw, who, "chat", job, route)
        if not job.stream:
            final = await answer(call, request)
            body = wire.message_body(
                job.request_id, job.model, final.choices[0] if final.choices else None, final.usage, applied
            )
            return json_response(body, headers=_headers(call))
        await call.admit()
        first = await until_disconnect(request, call.open())
        events = Events(job.request_id, job.model, applied)
        pieces = relay_stream(call, first, events.chunk, events.final, error=events.error)
        return Stream(pieces, media_type="text/event-stream", headers={**_headers(call), **STREAM_HEADERS})

    @post("/count_tokens", status_code=200)
    async def count_tokens(self, request: Request) -> Response:
        """The prompt's tokens as the engine counts them (its chat template, tools included): the prompt answered
        with one token, routed like the conversation so the count warms the cache its next turn reads."""
        who = self.caller(request)
        req = await read_json(request, wire.CountTokensRequest)
        job = wire.chat_job(req, new_request_id())
        route = chat_route(
            request, who, job, None, wire.session_id(req, request.headers.get(CLAUDE_CODE_SESSION_HEADER))
        )
        call = Call(self.gw, who, "chat", job, route)
        final = await answer(call, request)
        return json_response({"input_tokens": final.usage.prompt_tokens}, headers=_headers(call))
