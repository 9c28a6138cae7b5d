"""Anthropic's Messages API at the edge: its request types, their translation into a `ChatJob` (OpenAI-shaped
messages and tools, what every engine reads), and the engine's answer shaped back into Anthropic's message.

Pure functions, no I/O. Lenient on unknown fields (Claude Code sends betas: `cache_control` on any block,
`context_management`, `output_config`, ...), strict on the ones read. Claude Code's dialect (docs/api.md): `system`
entries inside `messages` (beta `mid-conversation-system`) are merged into the system prompt when they lead the
conversation and into the next user turn otherwise (chat templates refuse a system turn after the first); the
`x-anthropic-billing-header` system block, which differs per session and instructs nothing, is dropped so that two
sessions share their prompt prefix (the engine's cache and the router's prefix hash); its session id
(`X-Claude-Code-Session-Id`, or the `session_id` in `metadata.user_id`) is the router's session key.

Tool use ids: an engine's tool call id `x` is `toolu_x` to the client, and a `toolu_x` coming back (in `tool_use`
and `tool_result` blocks) is `x` again, so a round trip hands the engine the ids it made.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from coderai.contracts import ChatJob, Choice, RequestId, SamplingParams, Usage
from coderai.gateway.errors import ApiError
from coderai.gateway.seal import sealer

PositiveInt = Annotated[int, Meta(ge=1, le=2**31 - 1)]
Prob = Annotated[float, Meta(ge=0, le=1)]
TOOL_ID_PREFIX = "toolu_"
BILLING_PREFIX = "x-anthropic-billing-header:"
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "high", "xhigh": "high"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}


class CountTokensRequest(msgspec.Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    messages: Annotated[list[dict[str, Any]], Meta(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None  # applied as for a message (context_edited)
    metadata: dict[str, Any] | None = None


class MessagesRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/messages`, fields in the order of Anthropic's reference. `max_tokens` is required there too."""

    model: Annotated[str, Meta(min_length=1)]
    messages: Annotated[list[dict[str, Any]], Meta(min_length=1)]
    max_tokens: PositiveInt  # above the model's context: the engine stops when the context is full ("max_tokens")
    context_management: dict[str, Any] | None = None  # its clear_tool_uses and clear_thinking edits applied
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # `effort` becomes the engine's `reasoning_effort`
    stop_sequences: list[str] | None = None
    stream: bool = False
    system: str | list[dict[str, Any]] | None = None
    temperature: Prob | None = None
    thinking: dict[str, Any] | None = None
    tool_choice: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_k: int | None = None  # no engine takes it through the job: ignored
    top_p: Prob | None = None


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def tool_use_id(call_id: str | None) -> str:
    """The id the client sees for an engine's tool call (a fresh one when the engine gave none)."""
    if not call_id:
        return TOOL_ID_PREFIX + secrets.token_hex(12)
    return call_id if call_id.startswith(TOOL_ID_PREFIX) else TOOL_ID_PREFIX + call_id


def engine_call_id(use_id: str) -> str:
    """The engine's id again, for a `tool_use` or `tool_result` the client sends back."""
    return use_id[len(TOOL_ID_PREFIX):] if use_id.startswith(TOOL_ID_PREFIX) else use_id


def _text(value: Any, where: str) -> str:
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
        system = [b for b in system if not (isinstance(b, dict) and isinstance(b.get("text"), str)
                                            and b["text"].lstrip().startswith(BILLING_PREFIX))]
    elif isinstance(system, str) and system.lstrip().startswith(BILLING_PREFIX):
        return ""
    return _text(system, "system")


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as an OpenAI image part: base64 only. A URL is refused as chat refuses remote images: the
    head would fetch any address any key names."""
    src = block.get("source")
    if not isinstance(src, dict):
        raise _bad(f"{where}.source is required.", f"{where}.source")
    if src.get("type") != "base64":
        raise _bad(f"{where}.source must be base64 data; this server does not fetch images by URL or file id.",
                   f"{where}.source", "invalid_image_url")
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
                texts.append(_text([b], f"{where}.content"))
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
            raise _bad(f"{at}: a user message holds text, image, tool_result or text document blocks, not {kind!r}.",
                       at)
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
            calls.append({"id": engine_call_id(b["id"]), "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
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
            raise _bad(f"{where}: only client tools (name, description, input_schema) are supported, not "
                       f"Anthropic's server tools.", where, "unsupported_tool")
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


# --- context_management ------------------------------------------------------------------------------------

CLEARED = "[cleared to save context]"
DEFAULT_TRIGGER_TOKENS = 100_000  # Anthropic's defaults for clear_tool_uses: past this many input tokens,
DEFAULT_KEEP_TOOL_USES = 3  # keep the last three tool uses


def _estimate_tokens(value: Any) -> int:
    """A prompt's tokens before the engine counts them: a quarter of its JSON's characters, as for most tokenizers."""
    return len(json.dumps(value, ensure_ascii=False)) // 4


def _count(spec: Any, kind: str, default: int, where: str) -> int:
    if spec is None:
        return default
    if not isinstance(spec, dict) or spec.get("type") != kind or not isinstance(spec.get("value"), int) or \
            spec["value"] < 0:
        raise _bad(f"{where} must be {{\"type\": \"{kind}\", \"value\": <a count>}}.", where)
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


def _clear_tool_uses(req: Any, messages: list[dict[str, Any]], edit: dict[str, Any],
                     where: str) -> tuple[list[dict[str, Any]], dict[str, int]]:
    trigger = _count(edit.get("trigger"), "input_tokens", DEFAULT_TRIGGER_TOKENS, f"{where}.trigger")
    keep = _count(edit.get("keep"), "tool_uses", DEFAULT_KEEP_TOOL_USES, f"{where}.keep")
    exclude = set(edit.get("exclude_tools") or [])
    if _estimate_tokens([req.system, req.tools, messages]) < trigger:
        return messages, {}
    uses = [b for m in messages if m.get("role") == "assistant" and isinstance(m.get("content"), list)
            for b in m["content"] if isinstance(b, dict) and b.get("type") == "tool_use" and b.get("name") not in exclude]
    cleared = {b.get("id") for b in uses[:max(0, len(uses) - keep)]}
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


def _clear_thinking(messages: list[dict[str, Any]], edit: dict[str, Any],
                    where: str) -> tuple[list[dict[str, Any]], dict[str, int]]:
    keep_spec = edit.get("keep", {"type": "thinking_turns", "value": 1})
    if keep_spec == "all":
        return messages, {}
    keep = _count(keep_spec, "thinking_turns", 1, f"{where}.keep")
    thinking = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and isinstance(m.get("content"), list)
                and any(isinstance(b, dict) and b.get("type") in ("thinking", "redacted_thinking") for b in m["content"])]
    drop = set(thinking[:max(0, len(thinking) - keep)])
    if not drop:
        return messages, {}
    out, freed = [], 0
    for i, m in enumerate(messages):
        if i in drop:
            gone = [b for b in m["content"] if isinstance(b, dict) and b.get("type") in ("thinking", "redacted_thinking")]
            freed += _estimate_tokens(gone)
            m = {**m, "content": [b for b in m["content"] if b not in gone] or [{"type": "text", "text": ""}]}
        out.append(m)
    return out, {"cleared_thinking_turns": len(drop), "cleared_input_tokens": freed}


def chat_job(req: MessagesRequest | CountTokensRequest, request_id: str,
             messages: list[dict[str, Any]] | None = None) -> ChatJob:
    """The chat job of a Messages request. A token count is the same prompt answered with one token."""
    counting = isinstance(req, CountTokensRequest)
    tools = openai_tools(req.tools)
    tool_choice, parallel = openai_tool_choice(req.tool_choice) if tools and not counting else (None, None)
    if req.tool_choice and req.tool_choice.get("type") in ("any", "tool") and not tools:
        raise _bad("tool_choice names tools, but no tools were given.", "tool_choice")
    options = thinking_options(req.thinking)
    effort = (req.output_config or {}).get("effort")
    if isinstance(effort, str) and effort in EFFORTS and options.get("chat_template_kwargs", {}).get(
            "enable_thinking", True):
        options["reasoning_effort"] = EFFORTS[effort]
    if parallel is not None:
        options["parallel_tool_calls"] = parallel
    if counting:
        params = SamplingParams(max_tokens=1, temperature=0)
    else:
        stops = req.stop_sequences or []
        if not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop_sequences must be non-empty strings.", "stop_sequences")
        params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, stop=stops)
    if messages is None:
        messages = context_edited(req)[0]
    return ChatJob(request_id=RequestId(request_id), model=req.model, messages=openai_messages(req.system, messages),
                   params=params, tools=tools, tool_choice=tool_choice, stream=False if counting else req.stream,
                   options=options or None)


def _user_id_parts(req: MessagesRequest | CountTokensRequest) -> tuple[str | None, str | None]:
    """(the user, the session) in `metadata.user_id`. Claude Code writes either a JSON object as text
    (`{"device_id": ..., "account_uuid": ..., "session_id": ...}`) or `user_<hash>_account_<uuid>_session_<uuid>`;
    anything else is the user alone."""
    uid = (req.metadata or {}).get("user_id")
    if not isinstance(uid, str) or not uid:
        return None, None
    if uid.startswith("{"):
        try:
            data = json.loads(uid)
        except ValueError:
            data = None
        if isinstance(data, dict):
            session = data.get("session_id")
            rest = {k: v for k, v in data.items() if k != "session_id" and v}
            user = json.dumps(rest, sort_keys=True) if rest else None
            return user, session if isinstance(session, str) and session else None
    user, sep, session = uid.partition("_session_")
    return (user or None, session or None) if sep else (uid, None)


def user_id(req: MessagesRequest | CountTokensRequest) -> str | None:
    """`metadata.user_id` without its session: the affinity key chat takes from OpenAI's `user`."""
    return _user_id_parts(req)[0]


def session_id(req: MessagesRequest | CountTokensRequest, header: str | None) -> str | None:
    """The session Claude Code names: its `X-Claude-Code-Session-Id` header, else the one in `metadata.user_id`."""
    return header or _user_id_parts(req)[1]


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
    return {"input_tokens": u.prompt_tokens - cached, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def message_body(rid: str, model: str, choice: Choice | None, usage: Usage,
                 applied: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The whole answer as Anthropic's `message`: thinking, text, then tool_use blocks."""
    msg = (choice.message if choice else None) or {}
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"],
                        "signature": sealer().sign(msg["reasoning_content"])})
    if msg.get("content"):
        text = msg["content"] if isinstance(msg["content"], str) else _text(msg["content"], "content")
        content.append({"type": "text", "text": text})
    calls = msg.get("tool_calls") or []
    for c in calls:
        fn = c.get("function") or {}
        content.append({"type": "tool_use", "id": tool_use_id(c.get("id")), "name": fn.get("name", ""),
                        "input": tool_input(fn.get("arguments"))})
    return {"id": f"msg_{rid}", "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(choice.finish_reason if choice else None, bool(calls)), "stop_sequence": None,
            "usage": usage_json(usage), **({"context_management": {"applied_edits": applied}} if applied else {})}
