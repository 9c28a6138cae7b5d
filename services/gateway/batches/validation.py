"""A batch's input file, line by line: each line is checked exactly as the request it holds would be (the same
request types and job builders as `/v1/chat/completions`, `/v1/embeddings` and `/v1/responses`), and becomes
the op's job plus the function that turns the engine's answer into that endpoint's response body."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from coderai.contracts import ChatJob, EmbedJob, EmbedResult, Final
from coderai.contracts.jobs import EngineOp
from coderai.gateway.batches.records import LineError
from coderai.gateway.errors import ApiError
from coderai.gateway.openai import formats, sse
from coderai.gateway.openai.chat_types import ChatCompletionRequest, chat_job
from coderai.gateway.openai.embeddings import EmbeddingRequest, embed_job

ENDPOINTS: dict[str, EngineOp] = {"/v1/chat/completions": "chat", "/v1/embeddings": "embed", "/v1/responses": "chat"}
MAX_LINES = 50_000  # OpenAI's bound on one batch

Render = Callable[[Final, str, int], dict[str, Any]]  # (answer, request id, created) -> the response body


@dataclass(frozen=True)
class Line:
    """One request of the file: its place (`index`, from 0 among the request lines), its job and its renderer."""

    index: int
    custom_id: str
    op: EngineOp
    job: ChatJob | EmbedJob
    render: Render


def parse(data: bytes, endpoint: str, check_model: Callable[[str, str], object]) -> tuple[list[Line], list[LineError]]:
    """The file's requests, and what is wrong with the others (each error names its line, from 1).
    `check_model(model, op)` raises the ApiError a request for that model would get."""
    op = ENDPOINTS[endpoint]
    lines: list[Line] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    index = 0
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        if index >= MAX_LINES:
            errors.append(
                LineError(code="too_many_requests", message=f"A batch holds at most {MAX_LINES} requests.", line=number)
            )
            break
        try:
            line = _line(raw, endpoint, op, index, seen, check_model)
        except ApiError as err:
            errors.append(
                LineError(code=err.code or "invalid_request", message=err.message, param=err.param, line=number)
            )
        else:
            lines.append(line)
        index += 1
    if not lines and not errors:
        errors.append(LineError(code="empty_file", message="The input file holds no requests."))
    return lines, errors


def _bad(code: str, message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _line(
    raw: bytes, endpoint: str, op: EngineOp, index: int, seen: set[str], check_model: Callable[[str, str], object]
) -> Line:
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise _bad("invalid_json_line", "This line is not valid JSON.") from None
    if not isinstance(obj, dict):
        raise _bad("invalid_json_line", "Each line must be a JSON object.")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _bad("missing_required_parameter", "custom_id is required (a non-empty string).", "custom_id")
    if custom_id in seen:
        raise _bad(
            "duplicate_custom_id",
            f"The custom_id '{custom_id}' is used on an earlier line; each line's custom_id must be unique.",
            "custom_id",
        )
    seen.add(custom_id)
    if obj.get("method") != "POST":
        raise _bad("invalid_method", "method must be POST.", "method")
    if obj.get("url") != endpoint:
        raise _bad("invalid_url", f"url must be the batch's endpoint, {endpoint}.", "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _bad("missing_required_parameter", "body is required (a JSON object: the request).", "body")
    if body.get("stream"):
        raise _bad("invalid_request", "stream is not supported in a batch: each answer is kept whole.", "body.stream")
    try:
        job, render = _job(endpoint, body)
        check_model(job.model, op)
    except ApiError as err:
        raise _bad(err.code or "invalid_request", err.message, f"body.{err.param}" if err.param else "body") from None
    return Line(index=index, custom_id=custom_id, op=op, job=job, render=render)


T = TypeVar("T")


def _request(body: dict[str, Any], type_: type[T]) -> T:
    try:
        return msgspec.convert(body, type_)
    except msgspec.ValidationError as exc:
        raise _bad("invalid_request", f"Invalid request: {exc}") from None


def _job(endpoint: str, body: dict[str, Any]) -> tuple[ChatJob | EmbedJob, Render]:
    """The job (with a request id drawn again when the line runs) and how its answer becomes the body."""
    if endpoint == "/v1/chat/completions":
        chat = _request(body, ChatCompletionRequest)
        job = chat_job(chat, "pending")
        return job, lambda f, rid, created: sse.chat_response(rid, created, job.model, f.choices, f.usage)
    if endpoint == "/v1/embeddings":
        emb = _request(body, EmbeddingRequest)
        job = embed_job(emb, "pending")
        return job, lambda f, rid, created: formats.embeddings(
            formats.result(f, EmbedResult), emb.model, emb.encoding_format, f.usage
        )
    return _responses(body)


def _responses(body: dict[str, Any]) -> tuple[ChatJob, Render]:
    from coderai.gateway.openai import responses_types as rt  # its own module; imported where it is used

    req = rt.parse_request(body)
    if req.previous_response_id:
        raise _bad(
            "unsupported_parameter",
            "previous_response_id is not supported in a batch: send the whole conversation as input.",
            "previous_response_id",
        )
    job, _ = rt.response_job(req, "pending")

    def render(f: Final, rid: str, created: int) -> dict[str, Any]:
        choice = f.choices[0]
        return rt.response_body(
            rt.new_id("resp"), created, req, rt.from_choice(choice), f.usage, rt.final_status(choice.finish_reason)
        )

    return job, render
