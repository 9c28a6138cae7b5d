"""Anthropic's Messages API, the engine's answer shaped back: the whole `message` (thinking, text, then tool_use
blocks), its stop reason and its usage, which the streamed events (anthropic.py) share.
"""

from __future__ import annotations

import json
from typing import Any

from coderai.contracts import Choice, Usage
from coderai.gateway.anthropic_messages import joined_text, tool_use_id
from coderai.gateway.seal import sealer

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}


def stop_reason(finish: str | None, tool_calls: bool = False) -> str:
    return "tool_use" if tool_calls else STOP_REASONS.get(finish or "stop", "end_turn")


def tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's JSON arguments as the `input` object (text that is no JSON object is kept whole)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def usage_json(u: Usage) -> dict[str, int]:
    """Anthropic's usage: the prompt's tokens the engine found in its cache (its real prefix-cache hits, whether or
    not the request marked blocks with `cache_control`) are `cache_read_input_tokens`, the rest `input_tokens`;
    the engine caches as it reads, so nothing is counted as a cache write."""
    cached = min(max(u.cached_tokens, 0), u.prompt_tokens)
    return {
        "input_tokens": u.prompt_tokens - cached,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def message_body(
    rid: str, model: str, choice: Choice | None, usage: Usage, applied: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The whole answer as Anthropic's `message`: thinking, text, then tool_use blocks."""
    msg = (choice.message if choice else None) or {}
    content: list[dict[str, Any]] = []
    if isinstance(thought := msg.get("reasoning_content"), str) and thought:
        content.append({"type": "thinking", "thinking": thought, "signature": sealer().sign(thought)})
    if msg.get("content"):
        text = msg["content"] if isinstance(msg["content"], str) else joined_text(msg["content"], "content")
        content.append({"type": "text", "text": text})
    calls = msg.get("tool_calls")
    for c in calls if isinstance(calls, list) else ():
        fn = c.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": tool_use_id(c.get("id")),
                "name": fn.get("name", ""),
                "input": tool_input(fn.get("arguments")),
            }
        )
    return {
        "id": f"msg_{rid}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(choice.finish_reason if choice else None, bool(calls)),
        "stop_sequence": None,
        "usage": usage_json(usage),
        **({"context_management": {"applied_edits": applied}} if applied else {}),
    }
