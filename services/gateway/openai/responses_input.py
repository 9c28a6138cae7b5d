"""OpenAI's Responses API, a request's input as chat: its items (messages, function calls and their outputs,
reasoning this cluster sealed) as the chat messages a `ChatJob` carries.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from coderai.gateway.errors import ApiError
from coderai.gateway.openai.responses_tools import NS_SEP
from coderai.gateway.seal import sealer

if TYPE_CHECKING:
    from coderai.gateway.openai.responses_types import ResponseRequest

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# The items that record a hosted tool's run in a conversation sent back: nothing the chat template can show.
HOSTED_ITEMS = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "image_generation_call",
        "code_interpreter_call",
        "tool_search_call",
        "tool_search_output",
    }
)


def _bad(message: str, param: str | None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def input_items(req: ResponseRequest) -> list[dict[str, Any]]:
    """The request's input as Responses items (a string is one user message), as `input_items` lists them."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": req.input}]}]
    return req.input


def _parts(content: object, where: str) -> str | list[dict[str, Any]]:
    """A message item's content as chat content: a string when it is all text, else chat parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts.", f"{where}.content")
    out: list[dict[str, Any]] = []
    for j, p in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text", "refusal", "text", "summary_text", "reasoning_text"):
            text = p.get("text", p.get("refusal"))
            if not isinstance(text, str):
                raise _bad(f"{at}.text must be a string.", f"{at}.text")
            out.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = p.get("image_url")
            if not isinstance(url, str) or not url:
                raise _bad(f"{at}.image_url is required (file_id images are not supported).", f"{at}.image_url")
            if not url.startswith("data:"):
                raise _bad(
                    f"{at}.image_url must be a data: URL (data:image/png;base64,...); this server does not "
                    "fetch remote images.",
                    f"{at}.image_url",
                    "invalid_image_url",
                )
            out.append({"type": "image_url", "image_url": {"url": url, "detail": p.get("detail") or "auto"}})
        else:
            raise _bad(
                f"{at}.type {kind!r} is not supported; send input_text, output_text or input_image parts.",
                f"{at}.type",
                "unsupported_content",
            )
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _output_text(output: object, where: str) -> str:
    if isinstance(output, str):
        return output
    text = _parts(output, where)
    if not isinstance(text, str):
        raise _bad(f"{where}.output must be text.", f"{where}.output")
    return text


def to_messages(items: list[dict[str, Any]], param: str = "input") -> list[dict[str, Any]]:
    """Responses input items as chat messages: messages by role, `function_call` items as an assistant's
    tool_calls (joined onto the assistant turn before them), `function_call_output` items as tool messages.
    A reasoning item's `encrypted_content`, if this cluster sealed it, is the next assistant turn's reasoning
    (for templates that take it back); other reasoning items are dropped."""
    out: list[dict[str, Any]] = []
    thought: str | None = None  # opened from the last reasoning item, for the assistant turn that follows it
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object.", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            raw_role = item.get("role")
            role = ROLES.get(raw_role) if isinstance(raw_role, str) else None
            if role is None:
                raise _bad(f"{where}.role must be one of user, assistant, system, developer.", f"{where}.role")
            out.append({"role": role, "content": _parts(item.get("content"), where)})
            if role == "assistant" and thought:
                out[-1]["reasoning_content"], thought = thought, None
        elif kind in ("function_call", "custom_tool_call"):
            field = "arguments" if kind == "function_call" else "input"
            call_id, name, args = item.get("call_id"), item.get("name"), item.get(field, "")
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, str):
                raise _bad(f"{where} needs call_id, name and {field} as strings.", where)
            if kind == "custom_tool_call":
                args = json.dumps({"input": args}, ensure_ascii=False)
            if isinstance(item.get("namespace"), str) and item["namespace"]:
                name = item["namespace"] + NS_SEP + name
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if thought:
                out[-1]["reasoning_content"], thought = thought, None
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _bad(f"{where}.call_id must be a string.", f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _output_text(item.get("output"), where)})
        elif kind == "reasoning":
            thought = sealer().open(item.get("encrypted_content"))
            continue
        elif kind in HOSTED_ITEMS:
            continue
        else:
            raise _bad(
                f"{where}.type {kind!r} is not supported; send message, function_call, function_call_output, "
                "custom_tool_call, custom_tool_call_output or reasoning items.",
                f"{where}.type",
                "unsupported_input",
            )
    return out
