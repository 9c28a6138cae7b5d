"""Anthropic's `context_management` on a Messages request: its `clear_tool_uses` and `clear_thinking` edits applied
to the conversation before it becomes a job, and the edits that cleared anything told back (`applied_edits`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from coderai.gateway.errors import ApiError

if TYPE_CHECKING:
    from coderai.gateway.anthropic_types import CountTokensRequest, MessagesRequest

CLEARED = "[cleared to save context]"
DEFAULT_TRIGGER_TOKENS = 100_000  # Anthropic's defaults for clear_tool_uses: past this many input tokens,
DEFAULT_KEEP_TOOL_USES = 3  # keep the last three tool uses


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _estimate_tokens(value: Any) -> int:
    """A prompt's tokens before the engine counts them: a quarter of its JSON's characters, as for most tokenizers."""
    return len(json.dumps(value, ensure_ascii=False)) // 4


def _count(spec: Any, kind: str, default: int, where: str) -> int:
    if spec is None:
        return default
    if (
        not isinstance(spec, dict)
        or spec.get("type") != kind
        or not isinstance(spec.get("value"), int)
        or spec["value"] < 0
    ):
        raise _bad(f'{where} must be {{"type": "{kind}", "value": <a count>}}.', where)
    return spec["value"]


def context_edited(req: MessagesRequest | CountTokensRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`req.messages` with its `context_management` edits applied, and the edits that cleared anything (Anthropic's
    `applied_edits`). `clear_tool_uses_*`: past `trigger` input tokens (estimated here), the results of all but
    the last `keep` tool uses (not those of `exclude_tools`) are replaced by a short note, and with
    `clear_tool_inputs` their inputs too. `clear_thinking_*`: thinking blocks of all but the last `keep` assistant
    turns with thinking are dropped (`keep: "all"` keeps every one). Other edit types are accepted and not applied."""
    cm = req.context_management
    if not cm:
        return req.messages, []
    edits = cm.get("edits") if isinstance(cm, dict) else None
    if not isinstance(edits, list):
        raise _bad("context_management.edits must be a list.", "context_management.edits")
    messages, applied = req.messages, []
    for i, edit in enumerate(edits):
        where = f"context_management.edits[{i}]"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not isinstance(kind, str):
            raise _bad(f"{where}.type must be a string.", f"{where}.type")
        if kind.startswith("clear_tool_uses"):
            messages, done = _clear_tool_uses(req, messages, edit, where)
        elif kind.startswith("clear_thinking"):
            messages, done = _clear_thinking(messages, edit, where)
        else:
            continue
        if done:
            applied.append({"type": kind, **done})
    return messages, applied


def _clear_tool_uses(
    req: Any, messages: list[dict[str, Any]], edit: dict[str, Any], where: str
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    trigger = _count(edit.get("trigger"), "input_tokens", DEFAULT_TRIGGER_TOKENS, f"{where}.trigger")
    keep = _count(edit.get("keep"), "tool_uses", DEFAULT_KEEP_TOOL_USES, f"{where}.keep")
    exclude = set(edit.get("exclude_tools") or [])
    if _estimate_tokens([req.system, req.tools, messages]) < trigger:
        return messages, {}
    uses = [
        b
        for m in messages
        if m.get("role") == "assistant" and isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, dict) and b.get("type") == "tool_use" and b.get("name") not in exclude
    ]
    cleared = {b.get("id") for b in uses[: max(0, len(uses) - keep)]}
    if not cleared:
        return messages, {}
    inputs = bool(edit.get("clear_tool_inputs"))
    out, freed = [], 0
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        blocks = []
        for b in content:
            if isinstance(b, dict) and b.get("type") == "tool_result" and b.get("tool_use_id") in cleared:
                freed += _estimate_tokens(b.get("content"))
                b = {**b, "content": CLEARED}
            elif inputs and isinstance(b, dict) and b.get("type") == "tool_use" and b.get("id") in cleared:
                freed += _estimate_tokens(b.get("input"))
                b = {**b, "input": {}}
            blocks.append(b)
        out.append({**m, "content": blocks})
    return out, {"cleared_tool_uses": len(cleared), "cleared_input_tokens": freed}


def _clear_thinking(
    messages: list[dict[str, Any]], edit: dict[str, Any], where: str
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    keep_spec = edit.get("keep", {"type": "thinking_turns", "value": 1})
    if keep_spec == "all":
        return messages, {}
    keep = _count(keep_spec, "thinking_turns", 1, f"{where}.keep")
    thinking = [
        i
        for i, m in enumerate(messages)
        if m.get("role") == "assistant"
        and isinstance(m.get("content"), list)
        and any(isinstance(b, dict) and b.get("type") in ("thinking", "redacted_thinking") for b in m["content"])
    ]
    drop = set(thinking[: max(0, len(thinking) - keep)])
    if not drop:
        return messages, {}
    out, freed = [], 0
    for i, m in enumerate(messages):
        if i in drop:
            gone = [
                b for b in m["content"] if isinstance(b, dict) and b.get("type") in ("thinking", "redacted_thinking")
            ]
            freed += _estimate_tokens(gone)
            m = {**m, "content": [b for b in m["content"] if b not in gone] or [{"type": "text", "text": ""}]}
        out.append(m)
    return out, {"cleared_thinking_turns": len(drop), "cleared_input_tokens": freed}
