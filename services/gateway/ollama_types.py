"""Ollama's API at the edge, its inference requests (`/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`)
and their pieces in the OpenAI terms a job takes: `options` as sampling parameters, `keep_alive` in seconds, `format`
as a response format, messages (images, tool calls) as OpenAI's. And the shape of every NDJSON line Ollama writes.
"""

from __future__ import annotations

import datetime
import json
import re
from typing import Any

import msgspec

from coderai.contracts import SamplingParams
from coderai.gateway.errors import ApiError
from coderai.gateway.openai.chat_types import ROLES

NDJSON = "application/x-ndjson"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def line(obj: dict[str, Any]) -> bytes:
    return msgspec.json.encode(obj) + b"\n"


class ChatRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] | None = None
    format: Any = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: Any = None
    think: Any = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    model: str
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    format: Any = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: Any = None


class EmbedRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[str]
    truncate: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: Any = None
    dimensions: int | None = None


class EmbeddingsRequest(msgspec.Struct, kw_only=True):  # the older /api/embeddings
    model: str
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: Any = None


def params(options: dict[str, Any] | None) -> SamplingParams:
    """Ollama's `options` in the OpenAI names the engines take; options without an equivalent are ignored."""
    o = options or {}
    stop = o.get("stop") or []
    try:
        return SamplingParams(
            max_tokens=o.get("num_predict") if (o.get("num_predict") or 0) > 0 else None,
            temperature=o.get("temperature"),
            top_p=o.get("top_p"),
            seed=o.get("seed"),
            stop=[stop] if isinstance(stop, str) else list(stop),
            presence_penalty=o.get("presence_penalty"),
            frequency_penalty=o.get("frequency_penalty"),
        )
    except (TypeError, msgspec.ValidationError) as exc:
        raise ApiError(400, f"Invalid options: {exc}", param="options", code="invalid_request") from None


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def keep_alive(value: object) -> float | None:
    """Ollama's `keep_alive` in seconds: a number of seconds or a Go duration ("5m", "1h30m", "-1s"); negative
    keeps the model loaded for good, 0 unloads it once idle. None when the request sets none."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = value.strip() if isinstance(value, str) else ""
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
    try:
        return sign * float(body)
    except ValueError:
        pass
    parts = _DURATION.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise ApiError(
            400,
            f'keep_alive must be seconds or a duration such as "5m", not {value!r}.',
            param="keep_alive",
            code="invalid_value",
        )
    return sign * sum(float(n) * _UNIT_S[u] for n, u in parts)


def response_format(fmt: object) -> dict[str, Any] | None:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):  # a JSON schema
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt}}
    raise ApiError(400, 'format is "json" or a JSON schema.', param="format", code="invalid_request")


def openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama messages as OpenAI's: `images` (base64) become image parts, tool calls' arguments JSON text."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, "Each message is an object.", param=f"messages[{i}]", code="invalid_request")
        role, content = m.get("role", "user"), m.get("content") or ""
        if not isinstance(role, str) or role not in ROLES:  # the chat template would fail on it: a 502
            raise ApiError(
                400,
                f"messages[{i}].role must be one of {sorted(ROLES)}.",
                param=f"messages[{i}].role",
                code="invalid_request",
            )
        if not isinstance(content, str):
            raise ApiError(
                400, f"messages[{i}].content must be a string.", param=f"messages[{i}].content", code="invalid_request"
            )
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.get("images"):
            images = m["images"]
            if not isinstance(images, list) or not all(isinstance(img, str) for img in images):
                raise ApiError(
                    400, "images is a list of base64 strings.", param=f"messages[{i}].images", code="invalid_request"
                )
            msg["content"] = [{"type": "text", "text": msg["content"]}] + [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{img}"}} for img in images
            ]
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                _openai_call(c, j, f"messages[{i}].tool_calls[{j}]")
                for j, c in enumerate(_listed(m["tool_calls"], f"messages[{i}].tool_calls"))
            ]
        if m.get("role") == "tool" and m.get("tool_name"):
            msg["name"] = m["tool_name"]
        out.append(msg)
    return out


def _listed(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise ApiError(400, f"{param} is a list.", param=param, code="invalid_request")
    return value


def _openai_call(call: Any, index: int, param: str) -> dict[str, Any]:
    """One Ollama tool call (`{"function": {"name", "arguments": {...}}}`) as OpenAI's, checked like any input."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(
            400,
            'A tool call is {"function": {"name": ..., "arguments": {...}}}.',
            param=f"{param}.function",
            code="invalid_request",
        )
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": fn["name"], "arguments": json.dumps(fn.get("arguments") or {})},
    }
