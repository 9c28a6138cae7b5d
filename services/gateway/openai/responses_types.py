"""OpenAI's Responses API at the edge: the request, its translation into a `ChatJob` (the `chat` op runs it) and
the response object built from a chat answer. One import for them all: the request and its job are here; the input
items as chat messages in `responses_input`, the tools and output format in `responses_tools`, the response object
in `responses_output`.

Plain functions over plain data, with no HTTP request: `/v1/responses` and a batch's `/v1/responses` lines share
them. A stored conversation (`previous_response_id`) comes in as chat messages (`prior`), so the job is the whole
conversation and its affinity chain the same one the previous turn's was.
"""

from __future__ import annotations

from typing import Any

import msgspec

from coderai.contracts import ChatJob, RequestId, SamplingParams
from coderai.gateway.errors import ApiError
from coderai.gateway.openai.chat_types import PositiveInt, Prob, Temperature
from coderai.gateway.openai.responses_input import HOSTED_ITEMS, ROLES, input_items, to_messages
from coderai.gateway.openai.responses_output import (
    assistant_message,
    call_item,
    custom_input,
    final_body,
    final_status,
    from_choice,
    message_item,
    new_id,
    output_items,
    reasoning_item,
    response_body,
    restored,
    seal_reasoning,
    sealed,
    usage_json,
)
from coderai.gateway.openai.responses_tools import (
    CALLERS,
    HOSTED_TOOLS,
    NS_SEP,
    TOOL_CHOICES,
    chat_tool_choice,
    chat_tools,
    dropped_tools,
    echoed,
    response_format,
    tool_names,
)

__all__ = [
    "CALLERS",
    "EFFORTS",
    "HOSTED_ITEMS",
    "HOSTED_TOOLS",
    "NS_SEP",
    "ROLES",
    "TOOL_CHOICES",
    "WARNING_HEADER",
    "ResponseRequest",
    "assistant_message",
    "call_item",
    "custom_input",
    "dropped_tools",
    "echoed",
    "final_body",
    "final_status",
    "from_choice",
    "input_items",
    "message_item",
    "new_id",
    "output_items",
    "parse_request",
    "reasoning_item",
    "response_body",
    "response_job",
    "restored",
    "seal_reasoning",
    "sealed",
    "to_messages",
    "tool_names",
    "usage_json",
]

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
WARNING_HEADER = "Coderai-Warning"


class ResponseRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/responses`, fields in the order of OpenAI's reference; unknown ones are ignored."""

    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    background: bool | None = False
    conversation: object = None  # refused when given (as `prompt` is)
    include: list[str] | None = None
    max_output_tokens: PositiveInt | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    prompt: object = None
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


def _check(req: ResponseRequest) -> None:
    if not req.model:
        raise _bad("model is required.", "model")
    if req.conversation is not None or req.prompt is not None:
        field = "conversation" if req.conversation is not None else "prompt"
        raise _bad(
            f"{field} is not supported here; continue with previous_response_id.", field, "unsupported_parameter"
        )
    if req.background and not req.store:
        raise _bad("background responses must be stored (store: true).", "background")
    if req.background and req.stream:
        raise _bad("stream with background is not supported; poll GET /v1/responses/{id}.", "stream")
    if req.metadata is not None and (
        len(req.metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in req.metadata.items())
    ):
        raise _bad("metadata holds at most 16 pairs, keys up to 64 and values up to 512 characters.", "metadata")
    effort = (req.reasoning or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise _bad(f"reasoning.effort must be one of {', '.join(EFFORTS)}.", "reasoning.effort")


def response_job(
    body: dict[str, Any] | ResponseRequest, request_id: str, prior: list[dict[str, Any]] | None = None
) -> tuple[ChatJob, list[dict[str, Any]]]:
    """The chat job of a Responses request, and the conversation it continues (without the instructions, which
    a continuation does not inherit): `prior` (a stored response's messages) plus this input's messages."""
    req = parse_request(body)
    _check(req)
    conversation = [*(prior or []), *to_messages(input_items(req))]
    if not any(m["role"] == "user" for m in conversation):
        raise _bad("input needs at least one user message.", "input")
    system: list[dict[str, object]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    effort = (req.reasoning or {}).get("effort")
    options = {"reasoning_effort": effort, "parallel_tool_calls": req.parallel_tool_calls}
    job = ChatJob(
        request_id=RequestId(request_id),
        model=req.model,
        messages=system + conversation,
        params=SamplingParams(max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p),
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        response_format=response_format(req.text),
        stream=bool(req.stream),  # null became False in __post_init__
        options={k: v for k, v in options.items() if v is not None} or None,
    )
    return job, conversation
