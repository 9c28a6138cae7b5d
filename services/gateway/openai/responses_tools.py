"""OpenAI's Responses API, a request's tools and output format as chat's: function, custom (freeform) and namespace
tools flattened to chat's function tools, `tool_choice`, `text.format` as `response_format`, and the tools as the
response echoes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from coderai.gateway.errors import ApiError

if TYPE_CHECKING:
    from coderai.gateway.openai.responses_types import ResponseRequest

TOOL_CHOICES = ("auto", "none", "required")
# Tools OpenAI runs on its side. Nothing here can run them, and agents (Codex) send some that cannot be turned
# off: they are dropped, and the response says so in a `Coderai-Warning` header, rather than a 400.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "computer_use_preview",
        "computer_use",
        "computer",
        "image_generation",
        "local_shell",
        "tool_search",
    }
)
NS_SEP = "__"  # a namespace's tool as the template sees it: `<namespace>__<tool>`


def _bad(message: str, param: str | None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _function(t: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    """A function or custom (freeform) tool in chat's nested shape; a custom tool is a function of one string,
    `input`, its grammar (when it has one) told in the description."""
    fn: dict[str, Any] = {"name": name}  # chat's key order: templates render the tool as JSON
    if t.get("type") == "custom":
        fmt = t.get("format") or {}
        described = t.get("description") or ""
        if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
            described += f"\nThe input follows this {fmt.get('syntax') or 'grammar'} grammar:\n{fmt['definition']}"
        if described:
            fn["description"] = described.strip()
        fn["parameters"] = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
        return {"type": "function", "function": fn}
    if t.get("type") != "function":
        raise _bad(
            f"{where}.type {t.get('type')!r} is not supported; send function, custom or namespace tools.",
            f"{where}.type",
            "unsupported_tool",
        )
    if t.get("description"):
        fn["description"] = t["description"]
    fn["parameters"] = t.get("parameters") or {"type": "object", "properties": {}}
    if t.get("strict"):  # false is chat's default: left out, as a chat client leaves it out
        fn["strict"] = True
    return {"type": "function", "function": fn}


def _flat(tools: list[dict[str, Any]] | None) -> list[tuple[str, dict[str, Any], str | None, str]]:
    """Every tool the model may call, as (the name the template sees, the tool, its namespace, where it is);
    hosted tools left out."""
    out = []
    for i, t in enumerate(tools or []):
        kind, where = t.get("type"), f"tools[{i}]"
        if kind in HOSTED_TOOLS:
            continue
        if kind == "namespace":
            ns = t.get("name")
            if not isinstance(ns, str) or not ns or not isinstance(t.get("tools"), list):
                raise _bad(f"{where} needs a name and a list of tools.", where)
            for j, inner in enumerate(t["tools"]):
                name = inner.get("name") if isinstance(inner, dict) else None
                if not isinstance(name, str) or not name:
                    raise _bad(f"{where}.tools[{j}].name is required.", f"{where}.tools[{j}].name")
                out.append((ns + NS_SEP + name, inner, ns, f"{where}.tools[{j}]"))
            continue
        name = t.get("name")
        if kind in ("function", "custom") and (not isinstance(name, str) or not name):
            raise _bad(f"{where}.name is required.", f"{where}.name")
        out.append((name if isinstance(name, str) else "", t, None, where))
    return out


CALLERS = ("direct", "programmatic")


def echoed(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's tools as the response echoes them, less optional fields whose type OpenAI's schema does not
    allow (schemathesis sent `allowed_callers: -27179572`, and the echo broke the response schema), a namespace's
    own tools included. Nothing is refused for them: agents send fields of their own, and a tool the model can call is what matters."""
    out = []
    for t in tools or []:
        if not isinstance(t, dict):
            continue
        callers = t.get("allowed_callers")
        bad = {
            k
            for k, ok in (
                (
                    "allowed_callers",
                    callers is None
                    or (
                        isinstance(callers, list)
                        and all(c in CALLERS for c in callers)
                        and (bool(callers) or t.get("type") != "custom")
                    ),
                ),
                ("defer_loading", isinstance(t.get("defer_loading", False), bool)),
                ("description", t.get("description") is None or isinstance(t.get("description"), str)),
            )
            if not ok
        }
        kept = {k: v for k, v in t.items() if k not in bad} if bad else t
        if t.get("type") == "namespace" and isinstance(t.get("tools"), list):  # its tools, each cleaned alike
            kept = {**kept, "tools": echoed(t["tools"])}
        out.append(kept)
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' tools in chat's nested shape: function and custom tools, and a namespace's tools flattened to
    `<namespace>__<tool>`; hosted tools (HOSTED_TOOLS) dropped, any other kind refused by name."""
    return [_function(t, flat, where) for flat, t, _, where in _flat(tools)] or None


def dropped_tools(req: ResponseRequest) -> list[str]:
    """The hosted tools of a request, which the model cannot run and the job leaves out."""
    return sorted({t["type"] for t in req.tools or [] if t.get("type") in HOSTED_TOOLS})


def tool_names(req: ResponseRequest) -> dict[str, tuple[str, str | None, bool]]:
    """The template's tool names, each as (its name in the request, its namespace, whether it is custom)."""
    return {
        flat: (t.get("name", ""), ns, t.get("type") == "custom")
        for flat, t, ns, _ in _flat(req.tools)
        if flat != t.get("name") or ns is not None or t.get("type") == "custom"
    }


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses' `tool_choice` as chat's: a mode as is, a function or custom tool (a namespace's flattened) by name."""
    if choice is None or choice in TOOL_CHOICES:
        return choice
    if (
        isinstance(choice, dict)
        and choice.get("type") in ("function", "custom")
        and isinstance(choice.get("name"), str)
    ):
        ns = choice.get("namespace")
        name = ns + NS_SEP + choice["name"] if isinstance(ns, str) and ns else choice["name"]
        return {"type": "function", "function": {"name": name}}
    raise _bad('tool_choice must be auto, none, required or {"type": "function", "name": ...}.', "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`: None for plain text."""
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format.schema must be a JSON schema object.", "text.format.schema")
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": {"name": "response", **spec}}
    raise _bad("text.format.type must be text, json_object or json_schema.", "text.format.type")
