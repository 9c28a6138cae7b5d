"""Anthropic's Messages API at the edge: its request types and their translation into a `ChatJob` (OpenAI-shaped
messages and tools, what every engine reads), and the engine's answer shaped back into Anthropic's message. One
import for them all (`anthropic_types as wire`): the requests and the job are here; the messages, tools and thinking
translated in `anthropic_messages`, the `context_management` edits in `anthropic_context`, the answer in
`anthropic_answer`.

Pure functions, no I/O. Lenient on unknown fields (Claude Code sends betas: `cache_control` on any block,
`context_management`, `output_config`, ...), strict on the ones read. Claude Code's session id
(`X-Claude-Code-Session-Id`, or the `session_id` in `metadata.user_id`) is the router's session key.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from coderai.contracts import ChatJob, RequestId, SamplingParams
from coderai.gateway.anthropic_answer import STOP_REASONS, message_body, stop_reason, tool_input, usage_json
from coderai.gateway.anthropic_context import CLEARED, context_edited
from coderai.gateway.anthropic_messages import (
    BILLING_PREFIX,
    TOOL_ID_PREFIX,
    engine_call_id,
    openai_messages,
    openai_tool_choice,
    openai_tools,
    thinking_options,
    tool_use_id,
)
from coderai.gateway.errors import ApiError

__all__ = [
    "BILLING_PREFIX",
    "CLEARED",
    "STOP_REASONS",
    "TOOL_ID_PREFIX",
    "CountTokensRequest",
    "MessagesRequest",
    "chat_job",
    "context_edited",
    "engine_call_id",
    "message_body",
    "openai_messages",
    "openai_tool_choice",
    "openai_tools",
    "session_id",
    "stop_reason",
    "thinking_options",
    "tool_input",
    "tool_use_id",
    "usage_json",
    "user_id",
]

PositiveInt = Annotated[int, Meta(ge=1, le=2**31 - 1)]
Prob = Annotated[float, Meta(ge=0, le=1)]
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "high", "xhigh": "high"}


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


def chat_job(
    req: MessagesRequest | CountTokensRequest, request_id: str, messages: list[dict[str, Any]] | None = None
) -> ChatJob:
    """The chat job of a Messages request. A token count is the same prompt answered with one token."""
    counting = isinstance(req, CountTokensRequest)
    tools = openai_tools(req.tools)
    tool_choice, parallel = openai_tool_choice(req.tool_choice) if tools and not counting else (None, None)
    if req.tool_choice and req.tool_choice.get("type") in ("any", "tool") and not tools:
        raise _bad("tool_choice names tools, but no tools were given.", "tool_choice")
    options = thinking_options(req.thinking)
    effort = (req.output_config or {}).get("effort")
    if (
        isinstance(effort, str)
        and effort in EFFORTS
        and options.get("chat_template_kwargs", {}).get("enable_thinking", True)
    ):
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
    return ChatJob(
        request_id=RequestId(request_id),
        model=req.model,
        messages=openai_messages(req.system, messages),
        params=params,
        tools=tools,
        tool_choice=tool_choice,
        stream=False if counting else req.stream,
        options=options or None,
    )


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
