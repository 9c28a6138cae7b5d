"""Anthropic's Messages API, its request's content as OpenAI's: the system prompt and turns as chat messages, client
tools, `tool_choice` and `thinking`, what every engine reads (`anthropic_types.chat_job` puts them in a `ChatJob`).

Claude Code's dialect (docs/api.md): `system` entries inside `messages` (beta `mid-conversation-system`) are merged
into the system prompt when they lead the conversation and into the next user turn otherwise (chat templates refuse
a system turn after the first); the `x-anthropic-billing-header` system block, which differs per session and
instructs nothing, is dropped so that two sessions share their prompt prefix (the engine's cache and the router's
prefix hash).

Tool use ids: an engine's tool call id `x` is `toolu_x` to the client, and a `toolu_x` coming back (in `tool_use`
and `tool_result` blocks) is `x` again, so a round trip hands the engine the ids it made.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from coderai.gateway.errors import ApiError
from coderai.gateway.seal import sealer

TOOL_ID_PREFIX = "toolu_"
BILLING_PREFIX = "x-anthropic-billing-header:"


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def tool_use_id(call_id: str | None) -> str:
    """The id the client sees for an engine's tool call (a fresh one when the engine gave none)."""
    if not call_id:
        return TOOL_ID_PREFIX + secrets.token_hex(12)
    return call_id if call_id.startswith(TOOL_ID_PREFIX) else TOOL_ID_PREFIX + call_id


def engine_call_id(use_id: str) -> str:
    """The engine's id again, for a `tool_use` or `tool_result` the client sends back."""
    return use_id[len(TOOL_ID_PREFIX) :] if use_id.startswith(TOOL_ID_PREFIX) else use_id


def joined_text(value: Any, where: str) -> str:
    """A string, or a list of text blocks (system prompts, tool results), as one string."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, b in enumerate(value):
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise _bad(f"{where}[{j}] must be a text block.", f"{where}[{j}]")
            parts.append(b["text"])
        return "\n".join(parts)
    raise _bad(f"{where} must be a string or a list of text blocks.", where)


def _system_text(system: Any) -> str:
    """The system prompt's text without the billing block Claude Code puts first (see the module doc)."""
    if isinstance(system, list):
        system = [
            b
            for b in system
            if not (
                isinstance(b, dict) and isinstance(b.get("text"), str) and b["text"].lstrip().startswith(BILLING_PREFIX)
            )
        ]
    elif isinstance(system, str) and system.lstrip().startswith(BILLING_PREFIX):
        return ""
    return joined_text(system, "system")


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as an OpenAI image part: base64 only. A URL is refused as chat refuses remote images: the
    head would fetch any address any key names."""
    src = block.get("source")
    if not isinstance(src, dict):
        raise _bad(f"{where}.source is required.", f"{where}.source")
    if src.get("type") != "base64":
        raise _bad(
            f"{where}.source must be base64 data; this server does not fetch images by URL or file id.",
            f"{where}.source",
            "invalid_image_url",
        )
    media, data = src.get("media_type"), src.get("data")
    if not isinstance(media, str) or not isinstance(data, str) or not data:
        raise _bad(f"{where}.source needs media_type and data.", f"{where}.source")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def _tool_result(block: dict[str, Any], where: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A tool message, and the images of the result (they follow in a user message: a tool message is text)."""
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str) or not use_id:
        raise _bad(f"{where}.tool_use_id is required.", f"{where}.tool_use_id")
    content, images, texts = block.get("content"), [], []
    if isinstance(content, list):
        for j, b in enumerate(content):
            if isinstance(b, dict) and b.get("type") == "image":
                images.append(_image(b, f"{where}.content[{j}]"))
            else:
                texts.append(joined_text([b], f"{where}.content"))
        content = "\n".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise _bad(f"{where}.content must be a string or a list of blocks.", f"{where}.content")
    return {"role": "tool", "tool_call_id": engine_call_id(use_id), "content": content}, images


def _user(content: list[Any], where: str) -> list[dict[str, Any]]:
    """One user turn: its tool results first (they answer the assistant's last tool calls), then its text and
    images as one user message."""
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        at = f"{where}[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image":
            parts.append(_image(b, at))
        elif kind == "tool_result":
            msg, images = _tool_result(b, at)
            tools.append(msg)
            parts += images
        elif kind == "document" and isinstance(b.get("source"), dict) and b["source"].get("type") == "text":
            parts.append({"type": "text", "text": str(b["source"].get("data") or "")})
        else:
            raise _bad(
                f"{at}: a user message holds text, image, tool_result or text document blocks, not {kind!r}.", at
            )
    if not parts:
        return tools
    if all(p["type"] == "text" for p in parts):
        return tools + [{"role": "user", "content": "\n".join(p["text"] for p in parts)}]
    return tools + [{"role": "user", "content": parts}]


def _assistant(content: list[Any], where: str) -> dict[str, Any]:
    """One assistant turn: its text, its tool calls (arguments as JSON text), its thinking as reasoning."""
    texts, calls, thoughts = [], [], []
    for j, b in enumerate(content):
        at = f"{where}[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise _bad(f"{at} needs an id and a name.", at)
            calls.append(
                {
                    "id": engine_call_id(b["id"]),
                    "type": "function",
                    "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})},
                }
            )
        elif kind == "thinking":  # taken back only as this cluster signed it (gateway/seal.py)
            if sealer().verified(str(b.get("thinking") or ""), b.get("signature")):
                thoughts.append(str(b.get("thinking") or ""))
        elif kind != "redacted_thinking":  # opaque to anyone but Anthropic: dropped
            raise _bad(f"{at}: an assistant message holds text, tool_use or thinking blocks, not {kind!r}.", at)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:
        msg["reasoning_content"] = "".join(thoughts)
    return msg


def openai_messages(system: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic's system prompt and turns as OpenAI chat messages. `system` entries in `messages`: those before
    the first turn extend the system prompt; a later one is put, in order, at the head of the next user message
    (at the end of the last one when none follows), since most chat templates take one system turn, first."""
    head = [_system_text(system)] if system else []
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if role == "system":
            text = _system_text(content) if isinstance(content, (str, list)) else None
            if text is None:
                raise _bad(f"{where}.content must be a string or a list of text blocks.", f"{where}.content")
            if text:
                (pending if out else head).append(text)
            continue
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role must be 'user', 'assistant' or 'system'.", f"{where}.role")
        if isinstance(content, str):
            turn = [{"role": role, "content": content}]
        elif isinstance(content, list):
            turn = _user(content, f"{where}.content") if role == "user" else [_assistant(content, f"{where}.content")]
        else:
            raise _bad(f"{where}.content must be a string or a list of blocks.", f"{where}.content")
        if pending and role == "user" and turn and turn[-1]["role"] == "user":
            turn[-1] = _with_text(turn[-1], "\n".join(pending), first=True)
            pending = []
        out += turn
    if pending:
        if out and out[-1]["role"] == "user":
            out[-1] = _with_text(out[-1], "\n".join(pending), first=False)
        else:
            out.append({"role": "user", "content": "\n".join(pending)})
    system_text = "\n".join(t for t in head if t)
    return ([{"role": "system", "content": system_text}] if system_text else []) + out


def _with_text(message: dict[str, Any], text: str, first: bool) -> dict[str, Any]:
    """A user message with `text` before (or after) what it holds."""
    content = message["content"]
    if isinstance(content, str):
        return {**message, "content": f"{text}\n{content}" if first else f"{content}\n{text}"}
    part = {"type": "text", "text": text}
    return {**message, "content": [part, *content] if first else [*content, part]}


def openai_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Client tools as OpenAI function tools; Anthropic's server tools (web search, bash, ...) have no engine."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"{where}.name is required.", f"{where}.name")
        if t.get("type") not in (None, "custom") or not isinstance(t.get("input_schema"), dict):
            raise _bad(
                f"{where}: only client tools (name, description, input_schema) are supported, not "
                f"Anthropic's server tools.",
                where,
                "unsupported_tool",
            )
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def openai_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls) for Anthropic's `tool_choice`."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad("tool_choice.type must be auto, any, none or tool (with a name).", "tool_choice")


def thinking_options(thinking: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's `thinking` as the chat template switch reasoning models read (`enable_thinking`)."""
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise _bad("thinking.budget_tokens must be a positive integer.", "thinking.budget_tokens")
        return {"chat_template_kwargs": {"enable_thinking": True}}
    if kind == "adaptive":
        return {"chat_template_kwargs": {"enable_thinking": True}}
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    raise _bad("thinking.type must be enabled, adaptive or disabled.", "thinking.type")
