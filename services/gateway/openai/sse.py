"""OpenAI response bodies: chat/completion objects and exact SSE framing (`data: {...}\\n\\n` ... `data: [DONE]\\n\\n`)."""

from __future__ import annotations

from typing import Any

import msgspec

from coderai.contracts import Chunk, Choice, Usage

DONE = b"data: [DONE]\n\n"
LOADING = b": loading the model\n\n"  # an SSE comment: clients skip it; it keeps the stream alive during a load
_enc = msgspec.json.Encoder()


def sse(obj: object) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


def usage_json(u: Usage) -> dict[str, Any]:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens` is what the engine reused from its prompt cache."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _body(prefix: str, obj: str, rid: str, created: int, model: str, **rest: object) -> dict[str, Any]:
    """The envelope every OpenAI chat/completion object and chunk shares, key order as OpenAI sends it (no
    `system_fingerprint`: OpenAI's schema has no null for it, and an engine has none to give)."""
    return {"id": f"{prefix}-{rid}", "object": obj, "created": created, "model": model, **rest}


def chat_response(rid: str, created: int, model: str, choices: list[Choice], usage: Usage) -> dict[str, Any]:
    return _body(
        "chatcmpl",
        "chat.completion",
        rid,
        created,
        model,
        choices=[
            {
                "index": c.index,
                "message": {"role": "assistant", "content": None, "refusal": None, **(c.message or {})},
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        usage=usage_json(usage),
    )


def completion_response(rid: str, created: int, model: str, choices: list[Choice], usage: Usage) -> dict[str, Any]:
    return _body(
        "cmpl",
        "text_completion",
        rid,
        created,
        model,
        choices=[
            {"index": c.index, "text": c.text or "", "logprobs": c.logprobs, "finish_reason": c.finish_reason}
            for c in choices
        ],
        usage=usage_json(usage),
    )


def chat_chunk(rid: str, created: int, model: str, ch: Chunk) -> bytes:
    return sse(
        _body(
            "chatcmpl",
            "chat.completion.chunk",
            rid,
            created,
            model,
            choices=[
                {"index": ch.index, "delta": ch.delta or {}, "logprobs": ch.logprobs, "finish_reason": ch.finish_reason}
            ],
        )
    )


def completion_chunk(rid: str, created: int, model: str, ch: Chunk) -> bytes:
    return sse(
        _body(
            "cmpl",
            "text_completion",
            rid,
            created,
            model,
            choices=[
                {"index": ch.index, "text": ch.text or "", "logprobs": ch.logprobs, "finish_reason": ch.finish_reason}
            ],
        )
    )


def usage_chunk(kind: str, rid: str, created: int, model: str, usage: Usage) -> bytes:
    """The extra last chunk sent when `stream_options.include_usage` is set: no choices, only usage."""
    prefix, obj = ("chatcmpl", "chat.completion.chunk") if kind == "chat" else ("cmpl", "text_completion")
    return sse(_body(prefix, obj, rid, created, model, choices=[], usage=usage_json(usage)))
