"""`POST /v1/chat/completions` and `POST /v1/completions`: tokens streamed as SSE or a whole answer, with the
routing hints (session, user, prompt prefix, an admin's pin) the router's cache affinity uses."""

from __future__ import annotations

from functools import partial

from litestar import Request, Response, post
from litestar.response import Stream

from coderai.contracts import ChatJob, CompletionJob, Final, Op, RouteRequest
from coderai.gateway import affinity
from coderai.gateway.auth import Caller
from coderai.gateway.errors import ApiError
from coderai.gateway.http import (
    HARNESS_SESSION_HEADERS,
    PIN_HEADER,
    SESSION_HEADER,
    STREAM_HEADERS,
    json_response,
    new_request_id,
    read_json,
)
from coderai.gateway.openai import sse
from coderai.gateway.openai.chat_types import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_job,
    completion_job,
    include_usage,
)
from coderai.gateway.pipeline import Call, answer, open_stream
from coderai.gateway.state import InferenceController


class ChatController(InferenceController):
    @post("/v1/chat/completions", status_code=200)
    async def chat(self, request: Request) -> Response | Stream:
        who = self.caller(request)
        req = await read_json(request, ChatCompletionRequest)
        job = chat_job(req, new_request_id())
        route = chat_route(request, who, job, req.user)
        return await _serve(Call(self.gw, who, "chat", job, route), request, include_usage(req))

    @post("/v1/completions", status_code=200)
    async def completions(self, request: Request) -> Response | Stream:
        who = self.caller(request)
        req = await read_json(request, CompletionRequest)
        job = completion_job(req, new_request_id())
        route = route_request(request, who, job, "complete", req.user, affinity.prompt_chain(job.model, job.prompt))
        return await _serve(Call(self.gw, who, "complete", job, route), request, include_usage(req))


def chat_route(
    request: Request, who: Caller, job: ChatJob, user: str | None, session: str | None = None
) -> RouteRequest:
    """A chat job's route (chat completions, Responses, Anthropic Messages alike): keyed on the prefix chain of its
    whole conversation, so a conversation's next turn returns to the engine whose cache holds it."""
    return route_request(
        request, who, job, "chat", user, affinity.chat_chain(job.model, job.messages, job.tools), session
    )


def route_request(
    request: Request,
    who: Caller,
    job: ChatJob | CompletionJob,
    op: Op,
    user: str | None,
    prefix: list[str],
    session: str | None = None,
) -> RouteRequest:
    """What the router is asked: the model, and the affinity keys (gateway/affinity.py) and an admin's pin.
    `session` is one a harness names in its own way (Claude Code's header or metadata); `X-Session-Id` wins, and
    without either a harness's session header (`HARNESS_SESSION_HEADERS`: Open WebUI's chat id, ...) is the key."""
    headers = request.headers  # built anew from the scope at every access
    pin = headers.get(PIN_HEADER, "")
    if pin and "admin" not in who.scopes:
        raise ApiError(403, f"The {PIN_HEADER} header needs an admin key.", code="forbidden")
    named = (
        headers.get(SESSION_HEADER)
        or session
        or next((v for h in HARNESS_SESSION_HEADERS if (v := headers.get(h))), None)
    )
    return RouteRequest(
        request_id=job.request_id,
        model=job.model,
        op=op,
        pin=pin,
        prefix=prefix,
        session=affinity.session_key(job.model, named),
        user=affinity.user_key(job.model, user),
    )


async def _serve(call: Call, request: Request, want_usage: bool) -> Response | Stream:
    """The whole completion object, or its chunks as SSE (`data: {...}` ... `data: [DONE]`)."""
    job, chat = call.job, call.op == "chat"
    if not job.stream:
        whole = await answer(call, request)
        build = sse.chat_response if chat else sse.completion_response
        return json_response(
            build(job.request_id, call.created, job.model, whole.choices, whole.usage), headers=call.response_headers()
        )
    chunk = partial(sse.chat_chunk if chat else sse.completion_chunk, job.request_id, call.created, job.model)

    async def final(frame: Final) -> bytes:
        usage = sse.usage_chunk(call.op, job.request_id, call.created, job.model, frame.usage) if want_usage else b""
        return usage + sse.DONE

    events = await open_stream(call, request, chunk, final, lambda err: sse.sse(err.body()), sse.LOADING)
    return Stream(events, media_type="text/event-stream", headers={**call.response_headers(), **STREAM_HEADERS})
