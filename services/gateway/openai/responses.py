"""OpenAI's Responses API, `/v1/responses`: create (whole, streamed as OpenAI's events, or in the background),
retrieve, delete, `input_items` and cancel.

Agents' requests are taken as they come (docs/api.md, Responses): hosted tools the model cannot run are dropped with a
`Coderai-Warning` header, namespace and custom tools flattened to functions and restored in the output, the
session an agent names (`session-id`, `thread-id`, `prompt_cache_key`) is the affinity session, and a request
without `max_output_tokens` gets the gateway's `default_max_output_tokens` (within the model's context).

A response is a chat job (the `chat` op, through the one pipeline: limits, budgets, usage and metrics count it
like chat) over the whole conversation: a `previous_response_id`'s stored messages, then this input. Its affinity
chain is chat's over those messages, so a continuation goes to the engine whose cache holds the previous turn.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.params import FromPath
from litestar.response import Stream

from coderai.contracts import ChatJob, Final, RouteRequest
from coderai.gateway import affinity
from coderai.gateway.errors import ApiError
from coderai.gateway.http import STREAM_HEADERS, json_response, new_request_id, query_int, read_json, until_disconnect
from coderai.gateway.openai.chat import chat_route
from coderai.gateway.openai.files import page
from coderai.gateway.openai.responses_record import ResponseTenure, StoredResponse, with_ids
from coderai.gateway.openai.responses_store import Responses
from coderai.gateway.openai.responses_stream import EventStream
from coderai.gateway.openai.responses_types import (
    WARNING_HEADER,
    ResponseRequest,
    assistant_message,
    dropped_tools,
    final_body,
    input_items,
    new_id,
    response_body,
    response_job,
)
from coderai.gateway.pipeline import Call, answer, relay_stream
from coderai.gateway.state import InferenceController

log = logging.getLogger("coderai.gateway")
# The sessions agents name, strongest first, after X-Session-Id: Codex sends `session-id` and `thread-id` headers
# and the body's `prompt_cache_key` (the same id).
SESSION_HEADERS = ("session-id", "thread-id")


class ResponsesController(InferenceController):
    path = "/v1/responses"
    responses: Responses

    @post("/", status_code=200)
    async def create(self, request: Request) -> Response | Stream:
        who = self.caller(request)
        req = await read_json(request, ResponseRequest)
        prior = await self.responses.prior(who, req.previous_response_id) if req.previous_response_id else None
        job, conversation = response_job(req, new_request_id(), prior.messages if prior else None)
        job = await self._capped(job)
        route = _with_session(chat_route(request, who, job, req.user), request, req)
        call = Call(self.gw, who, "chat", job, route)
        if req.store or req.background:  # what it may keep, before any work
            await self.responses.admit(who, bool(req.background))
        dropped = dropped_tools(req)
        warn = {WARNING_HEADER: f"tools dropped, this server cannot run them: {', '.join(dropped)}"} if dropped else {}
        rec = StoredResponse(
            id=new_id("resp"),
            owner=who.key_name,
            created_at=call.created,
            response={},
            input_items=with_ids(input_items(req)),
            messages=conversation,
        )
        if req.background:
            return await self._background(call, req, rec, warn)
        if job.stream:
            return await self._stream(call, req, rec, request, warn)
        final = await answer(call, request)
        body = final_body(rec.id, rec.created_at, req, final)
        if req.store:
            await self._keep(rec, body)
        return json_response(body, headers={**call.response_headers(), **warn})

    async def _capped(self, job: ChatJob) -> ChatJob:
        """The job with the gateway's default output cap when it has none, within the model's context; left
        uncapped on a model whose context is unknown (its engine has its own default)."""
        default = self.gw.settings.default_max_output_tokens
        if job.params.max_tokens is not None or default <= 0:
            return job
        n_ctx = (await self.gw.find_model(job.model, "chat")).params.get("n_ctx")
        if not isinstance(n_ctx, int) or n_ctx <= 0:
            return job
        return msgspec.structs.replace(job, params=msgspec.structs.replace(job.params, max_tokens=min(default, n_ctx)))

    async def _keep(self, rec: StoredResponse, body: dict[str, Any]) -> None:
        rec.response = body
        rec.messages = [*rec.messages, assistant_message(body["output"])]
        await self.responses.put(rec)

    async def _stream(
        self, call: Call, req: ResponseRequest, rec: StoredResponse, request: Request, warn: dict[str, str]
    ) -> Stream:
        await call.admit()
        first = await until_disconnect(request, call.open())
        events = EventStream(rec.id, rec.created_at, req)
        head = events.start()

        async def final(frame: Final) -> bytes:
            tail, body = events.end(frame.usage)
            if req.store:
                try:
                    await self._keep(rec, body)
                except Exception as exc:  # the answer is out already; only its copy is lost
                    log.warning("could not store response %s: %s", rec.id, exc)
            return tail

        # relay_stream's iterator is an async generator (its annotation says only AsyncIterator): it can be closed
        pieces = cast(
            AsyncGenerator[bytes, None],
            relay_stream(call, first, events.chunk, final, error=lambda err: events.fail(err)[0]),
        )

        async def framed() -> AsyncIterator[bytes]:
            try:
                yield head
                async for piece in pieces:
                    yield piece
            finally:
                await pieces.aclose()  # a client gone: the relay stops the engine

        return Stream(
            framed(), media_type="text/event-stream", headers={**call.response_headers(), **STREAM_HEADERS, **warn}
        )

    async def _background(
        self, call: Call, req: ResponseRequest, rec: StoredResponse, warn: dict[str, str]
    ) -> Response:
        """Admitted now (a refused key hears it at once), stored as queued, run as a task of this process."""
        await call.admit()
        queued = response_body(rec.id, rec.created_at, req, [], None, "queued")
        rec.response, rec.runner, rec.updated_at = queued, self.responses.me, time.time()
        tenure = ResponseTenure(await self.responses.kv(), rec, await self.responses.put(rec))
        update = functools.partial(self.responses.update, runner=rec.runner)

        async def work() -> None:
            try:
                if not await update(rec.id, {**queued, "status": "in_progress"}):
                    call.abandon()  # cancelled or deleted before it started
                    return
                final = await answer(call)
            except asyncio.CancelledError:
                call.abandon()  # accounted once, wherever it was
                raise
            except Exception as exc:  # nobody awaits this task: the record says how it ended
                message = exc.message if isinstance(exc, ApiError) else "Internal error; see the gateway log."
                failed = response_body(
                    rec.id, rec.created_at, req, [], None, "failed", {"code": "server_error", "message": message}
                )
                await update(rec.id, failed)
                return
            body = final_body(rec.id, rec.created_at, req, final)
            await update(rec.id, body, [*rec.messages, assistant_message(body["output"])])

        self.responses.owners[rec.id] = rec.owner
        self.responses.run(tenure, work(), call.who)
        return json_response(queued, headers={**call.response_headers(), **warn})

    @get("/{response_id:str}")
    async def retrieve(self, request: Request, response_id: FromPath[str]) -> Response:
        return json_response((await self.responses.get(self.caller(request), response_id)).response)

    @delete("/{response_id:str}", status_code=200)
    async def remove(self, request: Request, response_id: FromPath[str]) -> Response:
        await self.responses.delete(self.caller(request), response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    @get("/{response_id:str}/input_items")
    async def items(self, request: Request, response_id: FromPath[str]) -> Response:
        """The input items, newest first (`order=asc` for oldest first), paged by `after`/`limit` (1..100)."""
        rec = await self.responses.get(self.caller(request), response_id)
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, "order must be asc or desc.", param="order", code="invalid_value")
        limit = query_int(request, "limit", 20, 1, 100)
        items = [_Item(it) for it in (rec.input_items if order == "asc" else reversed(rec.input_items))]
        data, more = page(items, q.get("after"), limit)
        return json_response(
            {
                "object": "list",
                "data": [it.item for it in data],
                "has_more": more,
                "first_id": data[0].id if data else None,
                "last_id": data[-1].id if data else None,
            }
        )

    @post("/{response_id:str}/cancel", status_code=200)
    async def cancel(self, request: Request, response_id: FromPath[str]) -> Response:
        return json_response(await self.responses.cancel(self.caller(request), response_id))


def _with_session(route: RouteRequest, request: Request, req: ResponseRequest) -> RouteRequest:
    """The route keyed on the session the agent names, unless X-Session-Id named one already."""
    if route.session:
        return route
    named = next((v for h in SESSION_HEADERS if (v := request.headers.get(h))), None) or req.prompt_cache_key
    return msgspec.structs.replace(route, session=affinity.session_key(route.model, named)) if named else route


class _Item:
    """An input item with the `.id` files' `page` pages by."""

    __slots__ = ("item", "id")

    def __init__(self, item: dict[str, Any]) -> None:
        self.item, self.id = item, item["id"]
