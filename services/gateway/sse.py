"""OpenAI response bodies: chat/completion objects and exact SSE framing (`data: {...}\\n\\n` ... `data: [DONE]\\n\\n`)."""

from __future__ import annotations

from typing import Any

import msgspec

from coderai.contracts import Chunk, Choice, Usage

DONE = b"data: [DONE]\n\n"
_enc = msgspec.json.Encoder()


def sse(obj: Any) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


def usage_json(u: Usage) -> dict[str, int]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens}


def chat_response(rid: str, created: int, model: str, choices: list[Choice], usage: Usage) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": c.index, "message": {"role": "assistant", "content": None, **(c.message or {})},
             "logprobs": None, "finish_reason": c.finish_reason}
            for c in choices
        ],
        "usage": usage_json(usage),
        "system_fingerprint": None,
    }


def completion_response(rid: str, created: int, model: str, choices: list[Choice], usage: Usage) -> dict[str, Any]:
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": c.index, "text": c.text or "", "logprobs": None, "finish_reason": c.finish_reason} for c in choices],
        "usage": usage_json(usage),
        "system_fingerprint": None,
    }


def chat_chunk(rid: str, created: int, model: str, ch: Chunk) -> bytes:
    return sse({
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": ch.index, "delta": ch.delta or {}, "logprobs": None, "finish_reason": ch.finish_reason}],
    })


def completion_chunk(rid: str, created: int, model: str, ch: Chunk) -> bytes:
    return sse({
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": ch.index, "text": ch.text or "", "logprobs": None, "finish_reason": ch.finish_reason}],
    })


def usage_chunk(kind: str, rid: str, created: int, model: str, usage: Usage) -> bytes:
    """The extra last chunk sent when `stream_options.include_usage` is set: no choices, only usage."""
    prefix, obj = ("chatcmpl", "chat.completion.chunk") if kind == "chat" else ("cmpl", "text_completion")
    return sse({"id": f"{prefix}-{rid}", "object": obj, "created": created, "model": model,
                "system_fingerprint": None, "choices": [], "usage": usage_json(usage)})
