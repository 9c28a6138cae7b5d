"""Fine-tuning files: JSONL chat examples (OpenAI's format), checked line by line. Pure; no I/O.

The gateway checks an upload with this before storing it (so a bad file is refused at once, naming the line),
and the trainer parses the same way, so what was accepted is exactly what trains.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
MAX_EXAMPLES = 100_000


class BadTrainingFile(ValueError):
    """The file is not usable for fine-tuning; `line` is 1-based (0: the file as a whole)."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line


def parse_examples(data: bytes) -> list[list[dict[str, Any]]]:
    """The chat examples of a JSONL file: one `{"messages": [...]}` object a line, blank lines skipped. Each
    message has a known `role` and string `content`; each example has at least one assistant message (the part a
    model learns from). BadTrainingFile names the first line at fault."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise BadTrainingFile(line, "is not UTF-8 text") from None
    examples: list[list[dict[str, Any]]] = []
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise BadTrainingFile(
                n, f"is not valid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON object"
            ) from None
        examples.append(_example(n, obj))
        if len(examples) > MAX_EXAMPLES:
            raise BadTrainingFile(n, f"more than {MAX_EXAMPLES} examples")
    if not examples:
        raise BadTrainingFile(0, "the file is empty: a fine-tune file needs at least one JSONL chat example")
    return examples


def _example(n: int, obj: Any) -> list[dict[str, Any]]:
    if not isinstance(obj, dict) or "messages" not in obj:
        raise BadTrainingFile(n, 'must be a JSON object with a "messages" list')
    extra = set(obj) - {"messages", "tools", "parallel_tool_calls"}
    if extra:
        raise BadTrainingFile(n, f'unknown key(s) {sorted(extra)}; an example has only "messages"')
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadTrainingFile(n, '"messages" must be a non-empty list')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadTrainingFile(n, f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise BadTrainingFile(n, f"messages[{i}] has role {role!r}; use one of {', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str) and not (role == "assistant" and m.get("tool_calls")):
            raise BadTrainingFile(n, f'messages[{i}] ({role}) needs string "content"')
        out.append({k: v for k, v in m.items() if k in ("role", "content", "name", "tool_calls", "tool_call_id")})
    if not any(m["role"] == "assistant" for m in out):
        raise BadTrainingFile(n, "has no assistant message to learn from")
    return out
