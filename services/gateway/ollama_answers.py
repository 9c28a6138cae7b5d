"""Ollama's answers, from the pipeline's frames: a whole answer's closing fields (the token counts and durations
Ollama reports), tool calls in Ollama's shape, and a stream as NDJSON, an object per piece, the last one `done`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from litestar import Request
from litestar.response import Stream

from coderai.contracts import Chunk, Final
from coderai.gateway.ollama_types import NDJSON
from coderai.gateway.ollama_types import line as _line
from coderai.gateway.ollama_types import now as _now
from coderai.gateway.pipeline import Call, open_stream


def ollama_tool_calls(calls: object) -> list[dict[str, Any]] | None:
    """OpenAI's tool calls (a list, from an answer's message) as Ollama's: arguments as JSON, not text."""
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for c in calls:
        fn = c.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = {"arguments": fn.get("arguments")}
        out.append({"function": {"name": fn.get("name", ""), "arguments": args}})
    return out


def done_fields(call: Call, final: Final, reason: str | None) -> dict[str, Any]:
    """What Ollama's last object carries: why it stopped, the token counts and the durations in nanoseconds: the
    engine's own timings where it gives them (llama-server does), else as measured here, from the first token
    (a whole answer has no first token to tell reading the prompt from generating: its time is all `eval`)."""
    total = int((time.monotonic() - call.started) * 1e9)
    u = final.usage
    if u.prompt_ms or u.generate_ms:
        prompt, gen = int(u.prompt_ms * 1e6), int(u.generate_ms * 1e6)
    else:
        prompt = int((call.ttft_s or 0) * 1e9) if call.streamed else 0
        gen = max(0, total - prompt)
    return {
        "done": True,
        "done_reason": reason or "stop",
        "total_duration": total,
        "load_duration": 0,
        "prompt_eval_count": u.prompt_tokens,
        "prompt_eval_duration": prompt,
        "eval_count": u.completion_tokens,
        "eval_duration": gen,
    }


class ToolCalls:
    """A stream's tool calls, put together from OpenAI's deltas (a name, then its arguments' JSON in pieces): Ollama
    streams each call whole, in a line of its own before the last."""

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, deltas: object) -> None:
        for d in deltas if isinstance(deltas, list) else ():
            if not isinstance(d, dict):
                continue
            fn = d.get("function")
            if not isinstance(fn, dict):
                fn = {}
            call = self.calls.setdefault(int(d.get("index") or 0), {"function": {"name": "", "arguments": ""}})
            for part in ("name", "arguments"):
                if isinstance(fn.get(part), str):
                    call["function"][part] += fn[part]

    def line(self, model: str) -> bytes:
        if not self.calls:
            return b""
        calls = ollama_tool_calls([self.calls[i] for i in sorted(self.calls)])
        return _line(
            {
                "model": model,
                "created_at": _now(),
                "message": {"role": "assistant", "content": "", "tool_calls": calls},
                "done": False,
            }
        )


def chat_piece(model: str, tools: ToolCalls, frame: Chunk) -> bytes:
    delta = frame.delta or {}
    if delta.get("tool_calls"):
        tools.add(delta["tool_calls"])
        if not delta.get("content") and not delta.get("reasoning_content"):
            return b""
    return _line(
        {
            "model": model,
            "created_at": _now(),
            "message": {
                "role": "assistant",
                "content": delta.get("content") or "",
                **({"thinking": delta["reasoning_content"]} if delta.get("reasoning_content") else {}),
            },
            "done": False,
        }
    )


def generate_piece(model: str, frame: Chunk) -> bytes:
    delta = frame.delta or {}
    return _line(
        {"model": model, "created_at": _now(), "response": frame.text or delta.get("content") or "", "done": False}
    )


async def ndjson_stream(
    call: Call,
    request: Request,
    chunk: Callable[[Chunk], bytes],
    head: Callable[[Final], dict[str, Any]],
    before_last: Callable[[], bytes] | None = None,
) -> Stream:
    """NDJSON: an object per piece, then (`before_last()`: the tool calls) one with `done` and the counts; an engine
    failure mid-stream is a last `{"error": ...}` line, as Ollama writes it."""
    reason: list[str | None] = [None]  # a streamed answer's finish reason rides on its last chunk

    def piece(frame: Chunk) -> bytes:
        if frame.finish_reason:
            reason[0] = frame.finish_reason
        return chunk(frame)

    async def final(frame: Final) -> bytes:
        return (before_last() if before_last else b"") + _line({**head(frame), **done_fields(call, frame, reason[0])})

    # no keep-alive while a model loads: Ollama's clients read every line as JSON (and Ollama sends none either)
    pieces = await open_stream(call, request, piece, final, lambda err: _line({"error": err.message}), None)
    return Stream(pieces, media_type=NDJSON, headers=call.response_headers())
