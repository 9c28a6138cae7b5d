"""OpenAI wire types at the edge: lenient on unknown fields, strict on the ones we read.

Unknown fields are ignored rather than logged: spotting them would cost a second parse of every body, and
the OpenAI API grows new optional fields faster than any server follows.

Fields follow the order of the OpenAI API reference. They are translated into internal jobs here, so
nothing OpenAI-shaped leaks into the bus contract beyond message/tool JSON that engines consume as is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from coderai.contracts import ChatJob, CompletionJob, RequestId, SamplingParams
from coderai.gateway.errors import ApiError

Temperature = Annotated[float, Meta(ge=0, le=2)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
Prob = Annotated[float, Meta(ge=0, le=1)]
LoraScale = Annotated[float, Meta(ge=0, le=4)]  # llama-server scales an adapter per request
PositiveInt = Annotated[int, Meta(ge=1, le=2**31 - 1)]
Bias = Annotated[float, Meta(ge=-100, le=100)]
MAX_CHOICES = 128  # prompts x n of one completions request
ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, kw_only=True):
    messages: Annotated[list[dict[str, Any]], Meta(min_length=1)]
    model: Annotated[str, Meta(min_length=1)]
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    n: Annotated[int, Meta(ge=1, le=16)] = 1
    presence_penalty: Penalty | None = None
    response_format: dict[str, Any] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: Prob | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # llama.cpp/vLLM's: e.g. {"enable_thinking": false}
    lora_scale: LoraScale | None = None  # coderai's: how much of a fine-tuned model's adapter (llama-server)
    user: str | None = None


class CompletionRequest(msgspec.Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    prompt: str | list[str]
    echo: bool = False
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    max_tokens: PositiveInt | None = None
    n: Annotated[int, Meta(ge=1, le=16)] = 1
    presence_penalty: Penalty | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: Temperature | None = None
    top_p: Prob | None = None
    user: str | None = None


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > 4:
        raise ApiError(400, "At most 4 stop sequences are allowed.", param="stop", code="invalid_request")
    return stops


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check roles; flatten text-only content parts into a string, which every chat template understands."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ApiError(
                400,
                f"messages[{i}].role must be one of {sorted(ROLES)}.",
                param=f"messages[{i}].role",
                code="invalid_request",
            )
        content = m.get("content")
        if isinstance(content, list):
            _check_parts(content, i)
            if all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                m = {**m, "content": "".join(str(p.get("text", "")) for p in content)}
        elif content is not None and not isinstance(content, str):
            raise ApiError(
                400,
                f"messages[{i}].content must be a string or a list of parts.",
                param=f"messages[{i}].content",
                code="invalid_request",
            )
        elif content is None and role != "assistant":
            raise ApiError(
                400,
                f"messages[{i}].content is required for role '{role}'.",
                param=f"messages[{i}].content",
                code="invalid_request",
            )
        if m.get("tool_calls") is not None:
            _check_calls(m["tool_calls"], i)
        out.append(m)
    return out


def _check_calls(calls: object, i: int) -> None:
    """An assistant message's earlier tool calls: function calls (`custom` ones have no chat template)."""
    if not isinstance(calls, list):
        raise ApiError(
            400, f"messages[{i}].tool_calls must be a list.", param=f"messages[{i}].tool_calls", code="invalid_request"
        )
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        kind = c.get("type", "function") if isinstance(c, dict) else None
        if kind != "function":
            raise ApiError(
                400,
                f'{where} must be a function call ({{"type": "function", "function": ...}}); '
                f"{kind!r} calls are not supported.",
                param=where,
                code="unsupported_tool_call",
            )
        fn = c.get("function")
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments", ""), str)
        ):
            raise ApiError(
                400,
                f"{where}.function needs a name and arguments (a JSON string).",
                param=f"{where}.function",
                code="invalid_request",
            )


def _check_parts(parts: list[object], i: int) -> None:
    """Content parts: text, and images as data URLs. A remote image URL is refused: fetching it would let any
    key make the head reach any address (and no engine fetches it itself)."""
    for j, p in enumerate(parts):
        where = f"messages[{i}].content[{j}]"
        if not isinstance(p, dict) or not isinstance(p.get("type"), str):
            raise ApiError(400, f"{where} must be an object with a type.", param=where, code="invalid_request")
        if p["type"] != "image_url":
            continue
        image = p.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str) or not url:
            raise ApiError(
                400, f"{where}.image_url.url is required.", param=f"{where}.image_url", code="invalid_request"
            )
        if not url.startswith("data:"):
            raise ApiError(
                400,
                f"{where}.image_url must be a data: URL (data:image/png;base64,...); this server does "
                "not fetch remote images.",
                param=f"{where}.image_url",
                code="invalid_image_url",
            )


def _logprobs(req: ChatCompletionRequest) -> tuple[bool, int | None]:
    top = req.top_logprobs
    if top is not None and not 0 <= top <= 20:
        raise ApiError(400, "top_logprobs must be between 0 and 20.", param="top_logprobs", code="invalid_request")
    if top is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true.", param="top_logprobs", code="invalid_request")
    return bool(req.logprobs), top


def _logit_bias(bias: dict[str, float] | None) -> dict[str, float] | None:
    """OpenAI's `logit_bias`: token ids (as JSON object keys) to a bias in -100..100."""
    if not bias:
        return None
    if len(bias) > 1024:
        raise ApiError(400, "logit_bias may name at most 1024 tokens.", param="logit_bias", code="invalid_request")
    for token in bias:
        if not token.isdigit():
            raise ApiError(
                400, f"logit_bias keys are token ids; '{token}' is not one.", param="logit_bias", code="invalid_request"
            )
    return bias


def chat_job(req: ChatCompletionRequest, request_id: str) -> ChatJob:
    rf = req.response_format
    if rf is not None and rf.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(
            400,
            "response_format.type must be text, json_object or json_schema.",
            param="response_format",
            code="invalid_request",
        )
    logprobs, top_logprobs = _logprobs(req)
    params = SamplingParams(
        max_tokens=req.max_completion_tokens or req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=_stops(req.stop),
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        n=req.n,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        logit_bias=_logit_bias(req.logit_bias),
    )
    options = {
        "reasoning_effort": req.reasoning_effort,
        "chat_template_kwargs": req.chat_template_kwargs,
        "parallel_tool_calls": req.parallel_tool_calls,
        "lora_scale": req.lora_scale,
    }
    return ChatJob(
        request_id=RequestId(request_id),
        model=req.model,
        messages=_messages(req.messages),
        params=params,
        tools=req.tools or None,
        tool_choice=req.tool_choice,
        response_format=rf if rf and rf.get("type") != "text" else None,
        stream=req.stream,
        options={k: v for k, v in options.items() if v is not None} or None,
    )


def _prompt(req: CompletionRequest) -> str | list[str]:
    """One prompt, or a list of them (a list of one is that one); token-id prompts are refused."""
    if isinstance(req.prompt, str):
        return req.prompt
    if not req.prompt:
        raise ApiError(400, "prompt must not be an empty list.", param="prompt", code="invalid_request")
    if len(req.prompt) * req.n > MAX_CHOICES:
        raise ApiError(
            400, f"At most {MAX_CHOICES} choices (prompts x n) per request.", param="prompt", code="invalid_request"
        )
    return req.prompt[0] if len(req.prompt) == 1 else list(req.prompt)


def completion_job(req: CompletionRequest, request_id: str) -> CompletionJob:
    prompt = _prompt(req)
    params = SamplingParams(
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=_stops(req.stop),
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        n=req.n,
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs,
        logit_bias=_logit_bias(req.logit_bias),
    )
    return CompletionJob(
        request_id=RequestId(request_id),
        model=req.model,
        prompt=prompt,
        params=params,
        echo=req.echo,
        stream=req.stream,
    )


def include_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


Kind = Literal["chat", "complete"]
