"""OpenAI's Responses API at the edge: the request, its translation into a `ChatJob` (the `chat` op runs it) and
the response object built from a chat answer.

Plain functions over plain data, with no HTTP request: `/v1/responses` and a batch's `/v1/responses` lines share
them. A stored conversation (`previous_response_id`) comes in as chat messages (`prior`), so the job is the whole
conversation and its affinity chain the same one the previous turn's was.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import msgspec

from coderai.contracts import ChatJob, Choice, Final, RequestId, SamplingParams, Usage
from coderai.gateway.errors import ApiError
from coderai.gateway.openai.chat_types import PositiveInt, Prob, Temperature
from coderai.gateway.seal import sealer

TOOL_CHOICES = ("auto", "none", "required")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# Tools OpenAI runs on its side. Nothing here can run them, and agents (Codex) send some that cannot be turned
# off: they are dropped, and the response says so in a `Coderai-Warning` header, rather than a 400.
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
                          "code_interpreter", "computer_use_preview", "computer_use", "computer", "image_generation",
                          "local_shell", "tool_search"})
# The items that record a hosted tool's run in a conversation sent back: nothing the chat template can show.
HOSTED_ITEMS = frozenset({"web_search_call", "file_search_call", "image_generation_call", "code_interpreter_call",
                          "tool_search_call", "tool_search_output"})
NS_SEP = "__"  # a namespace's tool as the template sees it: `<namespace>__<tool>`
WARNING_HEADER = "Coderai-Warning"


class ResponseRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/responses`, fields in the order of OpenAI's reference; unknown ones are ignored."""

    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    background: bool | None = False
    conversation: Any = None
    include: list[str] | None = None
    max_output_tokens: PositiveInt | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    prompt: Any = None
    prompt_cache_key: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = True
    stream: bool | None = False
    temperature: Temperature | None = None
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_p: Prob | None = None
    truncation: str | None = None
    user: str | None = None

    def __post_init__(self) -> None:  # OpenAI's schema lets these three be null: null is their default
        self.background = bool(self.background)
        self.store = True if self.store is None else self.store
        self.stream = bool(self.stream)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def _bad(message: str, param: str | None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def parse_request(body: dict[str, Any] | ResponseRequest) -> ResponseRequest:
    """A batch line's body (a dict) as the request; a 400 naming the field when it does not fit."""
    if isinstance(body, ResponseRequest):
        return body
    try:
        return msgspec.convert(body, ResponseRequest)
    except msgspec.ValidationError as exc:
        raise _bad(f"Invalid request: {exc}", None) from None


# --- input items -> chat messages ---------------------------------------------------------------------------


def input_items(req: ResponseRequest) -> list[dict[str, Any]]:
    """The request's input as Responses items (a string is one user message), as `input_items` lists them."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": req.input}]}]
    return req.input


def _parts(content: Any, where: str) -> str | list[dict[str, Any]]:
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
                raise _bad(f"{at}.image_url must be a data: URL (data:image/png;base64,...); this server does not "
                           "fetch remote images.", f"{at}.image_url", "invalid_image_url")
            out.append({"type": "image_url", "image_url": {"url": url, "detail": p.get("detail") or "auto"}})
        else:
            raise _bad(f"{at}.type {kind!r} is not supported; send input_text, output_text or input_image parts.",
                       f"{at}.type", "unsupported_content")
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _output_text(output: Any, where: str) -> str:
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
            role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
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
            raise _bad(f"{where}.type {kind!r} is not supported; send message, function_call, function_call_output, "
                       "custom_tool_call, custom_tool_call_output or reasoning items.", f"{where}.type",
                       "unsupported_input")
    return out


# --- tools, tool_choice, text.format, reasoning ------------------------------------------------------------


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
        raise _bad(f"{where}.type {t.get('type')!r} is not supported; send function, custom or namespace tools.",
                   f"{where}.type", "unsupported_tool")
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
    allow (schemathesis sent `allowed_callers: -27179572`, and the echo broke the response schema). Nothing is
    refused for them: agents send fields of their own, and a tool the model can call is what matters."""
    out = []
    for t in tools or []:
        if not isinstance(t, dict):
            continue
        callers = t.get("allowed_callers")
        bad = {k for k, ok in (
            ("allowed_callers", callers is None or (isinstance(callers, list) and all(c in CALLERS for c in callers)
                                                   and (bool(callers) or t.get("type") != "custom"))),
            ("defer_loading", isinstance(t.get("defer_loading", False), bool)),
            ("description", t.get("description") is None or isinstance(t.get("description"), str))) if not ok}
        out.append({k: v for k, v in t.items() if k not in bad} if bad else t)
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' tools in chat's nested shape: function and custom tools, and a namespace's tools flattened to
    `<namespace>__<tool>`; hosted tools (HOSTED_TOOLS) dropped, any other kind refused by name."""
    return [_function(t, flat, where) for flat, t, _, where in _flat(tools)] or None


def dropped_tools(req: ResponseRequest) -> list[str]:
    """The hosted tools of a request, which the model cannot run and the job leaves out."""
    return sorted({t.get("type") for t in req.tools or [] if t.get("type") in HOSTED_TOOLS})  # type: ignore[misc]


def tool_names(req: ResponseRequest) -> dict[str, tuple[str, str | None, bool]]:
    """The template's tool names, each as (its name in the request, its namespace, whether it is custom)."""
    return {flat: (t.get("name", ""), ns, t.get("type") == "custom") for flat, t, ns, _ in _flat(req.tools)
            if flat != t.get("name") or ns is not None or t.get("type") == "custom"}


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in TOOL_CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom") and isinstance(choice.get("name"), str):
        ns = choice.get("namespace")
        name = ns + NS_SEP + choice["name"] if isinstance(ns, str) and ns else choice["name"]
        return {"type": "function", "function": {"name": name}}
    raise _bad("tool_choice must be auto, none, required or {\"type\": \"function\", \"name\": ...}.", "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
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


def _check(req: ResponseRequest) -> None:
    if not req.model:
        raise _bad("model is required.", "model")
    if req.conversation is not None or req.prompt is not None:
        field = "conversation" if req.conversation is not None else "prompt"
        raise _bad(f"{field} is not supported here; continue with previous_response_id.", field, "unsupported_parameter")
    if req.background and not req.store:
        raise _bad("background responses must be stored (store: true).", "background")
    if req.background and req.stream:
        raise _bad("stream with background is not supported; poll GET /v1/responses/{id}.", "stream")
    if req.metadata is not None and (len(req.metadata) > 16 or any(
            len(k) > 64 or len(v) > 512 for k, v in req.metadata.items())):
        raise _bad("metadata holds at most 16 pairs, keys up to 64 and values up to 512 characters.", "metadata")
    effort = (req.reasoning or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise _bad(f"reasoning.effort must be one of {', '.join(EFFORTS)}.", "reasoning.effort")


def response_job(body: dict[str, Any] | ResponseRequest, request_id: str,
                 prior: list[dict[str, Any]] | None = None) -> tuple[ChatJob, list[dict[str, Any]]]:
    """The chat job of a Responses request, and the conversation it continues (without the instructions, which
    a continuation does not inherit): `prior` (a stored response's messages) plus this input's messages."""
    req = parse_request(body)
    _check(req)
    conversation = [*(prior or []), *to_messages(input_items(req))]
    if not any(m["role"] == "user" for m in conversation):
        raise _bad("input needs at least one user message.", "input")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    effort = (req.reasoning or {}).get("effort")
    options = {"reasoning_effort": effort, "parallel_tool_calls": req.parallel_tool_calls}
    job = ChatJob(
        request_id=RequestId(request_id), model=req.model, messages=system + conversation,
        params=SamplingParams(max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p),
        tools=_tools(req.tools), tool_choice=_tool_choice(req.tool_choice),
        response_format=_response_format(req.text), stream=req.stream,
        options={k: v for k, v in options.items() if v is not None} or None)
    return job, conversation


# --- a chat answer -> the response object ------------------------------------------------------------------


def usage_json(u: Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens or u.prompt_tokens + u.completion_tokens}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": "completed"}


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments the model gave its one-string function (as is if not that)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return arguments
    return args["input"] if isinstance(args, dict) and isinstance(args.get("input"), str) else arguments


def restored(item: dict[str, Any], names: dict[str, tuple[str, str | None, bool]] | None) -> dict[str, Any]:
    """A function_call item as the request named its tool: a namespace's tool with its `namespace` and own
    name, a custom tool's call as a `custom_tool_call` with its `input`."""
    known = (names or {}).get(item["name"])
    if known is None:
        return item
    name, ns, custom = known
    if custom:
        out = {"id": item["id"].replace("fc_", "ctc_", 1), "type": "custom_tool_call", "call_id": item["call_id"],
               "name": name, "input": custom_input(item["arguments"]), "status": item["status"]}
    else:
        out = {**item, "name": name}
    return {**out, "namespace": ns} if ns else out


def output_items(message: dict[str, Any], finish_reason: str | None,
                 names: dict[str, tuple[str, str | None, bool]] | None = None) -> list[dict[str, Any]]:
    """A chat answer's message as output items: reasoning, the text message, then one item per tool call."""
    out = []
    if message.get("reasoning_content"):
        out.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        status = "incomplete" if finish_reason == "length" else "completed"
        out.append(message_item(new_id("msg"), message.get("content") or "", status))
    for tc in calls:
        fn = tc.get("function") or {}
        out.append(restored(call_item(new_id("fc"), tc.get("id") or new_id("call"), fn.get("name", ""),
                                      fn.get("arguments", "")), names))
    return out


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the chat message a continuation sends back: text and tool calls, ids kept."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {
        "name": it["namespace"] + NS_SEP + it["name"] if it.get("namespace") else it["name"],
        "arguments": it["arguments"] if it["type"] == "function_call" else json.dumps({"input": it["input"]},
                                                                                        ensure_ascii=False)}}
             for it in output if it["type"] in ("function_call", "custom_tool_call")]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


def response_body(resp_id: str, created: float, req: ResponseRequest, output: list[dict[str, Any]],
                  usage: Usage | None, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The response object, in OpenAI's shape: `status` completed, incomplete (at the output token cap), queued,
    in_progress, cancelled or failed."""
    done = status in ("completed", "incomplete")
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": resp_id, "object": "response", "created_at": int(created), "status": status,
        "background": req.background, "completed_at": int(time.time()) if done else None,
        "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
        "model": req.model, "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
        "store": req.store, "temperature": req.temperature, "text": {"format": fmt, "verbosity": "medium"},
        "tool_choice": req.tool_choice or "auto", "tools": echoed(req.tools), "top_p": req.top_p,
        "truncation": req.truncation or "disabled",
        **({"usage": usage_json(usage)} if usage is not None else {}),  # none yet: left out (no null in the schema)
        **({"user": req.user} if req.user is not None else {}),  # OpenAI's schema has no null `user`
    }


def final_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def from_choice(choice: Choice, req: ResponseRequest | None = None) -> list[dict[str, Any]]:
    items = output_items(choice.message or {}, choice.finish_reason, tool_names(req) if req is not None else None)
    if req is not None and sealed(req):
        for item in items:
            if item["type"] == "reasoning":
                seal_reasoning(item)
    return items


def sealed(req: ResponseRequest) -> bool:
    """Whether the client asked for its reasoning back sealed, to send with its next turn (Codex, `store: false`)."""
    return "reasoning.encrypted_content" in (req.include or [])


def seal_reasoning(item: dict[str, Any]) -> None:
    """A reasoning item's text sealed into its `encrypted_content` (gateway/seal.py)."""
    item["encrypted_content"] = sealer().seal("".join(p.get("text", "") for p in item.get("content") or []))


def final_body(resp_id: str, created: float, req: ResponseRequest, final: Final) -> dict[str, Any]:
    """The response object of a whole chat answer (what `/v1/responses` and a batch's line answer)."""
    choice = final.choices[0] if final.choices else Choice()
    return response_body(resp_id, created, req, from_choice(choice, req), final.usage, final_status(choice.finish_reason))
