"""One request pipeline for every endpoint: admit -> fan-out | pick + first frame (failing over before it) ->
frames -> account exactly once (or a batch line's one part on the `WORK` queue: `Call.queued`).

A controller builds the op's job and a `Call`, then hands it to the adapter for its answer's shape: `answer` for a
whole answer (a JSON body), `relay_stream` for frames relayed as they come (SSE tokens, audio bytes). Whatever
happens (an error before or after the first frame, the client leaving, streamed or not), the engine job is
cancelled when nobody waits for it, the key's budget reservation is released and one `request.completed` is
published. Only this module calls the relay's `first_frame` and `spawn` and the accounts' `finish`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from litestar import Request
from nats.errors import Error as NatsError

from coderai.accounts.limits import REFRESH_EVERY_S, Reservation
from coderai.accounts.keys import ApiKey
from coderai.contracts import (
    BusError, Chunk, ErrorReply, Final, ModelConfig, RequestCompleted, RouteDecision, RouteRequest, Usage,
)
from coderai.contracts.jobs import BACKGROUND, INTERACTIVE
from coderai.contracts.ops import OPS
from coderai.contracts.topology import HDR_KEEP_ALIVE, HDR_KEY_NAME, HDR_REQUEST_ID
from coderai.gateway.accounting import (NO_TRACE, Admission, Trace, allowed, checked_usage, checked_work, price,
                                       usage_ceiling)
from coderai.gateway.auth import Caller
from coderai.gateway import affinity, seal
from coderai.gateway.bounds import check_schemas
from coderai.gateway.errors import ApiError, ClientGone, from_bus
from coderai.gateway.fanout import plans
from coderai.gateway.fanout.scatter import scatter
from coderai.gateway.http import ENGINE_HEADER, ROUTE_HEADER, client_request_id_var, priority_var, until_disconnect
from coderai.gateway.relay import next_frame
from coderai.gateway.state import Gateway
from coderai.media_work import Work
from coderai.runtime import tracing
from coderai.runtime.bus import FrameStream

log = logging.getLogger("coderai.gateway")

T = TypeVar("T")
NOT_ADMITTED = Admission(None)
_NO_USAGE = Usage()
HEADROOM = 4096  # bytes of a bus message kept for its subject, reply and headers



def output_limited(job: Any, cfg: ModelConfig, key: ApiKey | None = None) -> Any:
    """`job` with the model's and the key's output limits applied: the key's `default_output_tokens` (else the
    model's) when the request names none, capped at the lower of their `max_output_tokens`, and the model's `stop`
    sequences added to the request's own."""
    want = job.params.max_tokens
    default = (key.default_output_tokens if key else 0) or cfg.default_output_tokens
    if want is None and default > 0:
        want = default
    ceiling = min([c for c in (cfg.max_output_tokens, key.max_output_tokens if key else 0) if c > 0], default=0)
    if ceiling > 0 and (want is None or want > ceiling):
        want = ceiling
    stop = list(job.params.stop) + [s for s in cfg.stop if s and s not in job.params.stop]
    if want == job.params.max_tokens and stop == job.params.stop:
        return job
    return msgspec.structs.replace(job, params=msgspec.structs.replace(job.params, max_tokens=want, stop=stop))


# what a UI's background task begins its prompt with: Open WebUI's title, tags, follow-up, query and autocomplete
# tasks all open with this heading
TASK_MARKERS = ("### Task:",)


def prioritised(job: Any, header: int | None) -> Any:
    """`job` with its priority: the request's header's, else BACKGROUND for a UI's background task (its last user
    message opens with a task marker), else interactive as it came."""
    priority = header
    if priority is None:
        last = next((m for m in reversed(getattr(job, "messages", None) or []) if m.get("role") == "user"), None)
        text = _first_text(last.get("content")) if last else ""
        priority = BACKGROUND if text.lstrip().startswith(TASK_MARKERS) else INTERACTIVE
    return job if priority == job.priority else msgspec.structs.replace(job, priority=priority)


def _first_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    for part in content if isinstance(content, list) else []:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            return part["text"]
    return ""


TENANT_KEEP_ALIVE_MAX_S = 3600.0  # the longest a tenant's keep_alive holds a model, unless the model's own is longer


def tenant_keep_alive(cfg: ModelConfig, asked: float) -> float | None:
    """What a key without the admin scope may ask of Ollama's `keep_alive`: to keep the model loaded a while, up to
    the longer of the model's own idle time and an hour. Never to unload it (0: other tenants may be using it) nor to
    pin it for good (< 0); either is taken as not asked, and the model keeps its own policy."""
    if asked <= 0:
        return None
    own = cfg.keep_alive()
    return min(asked, max(TENANT_KEEP_ALIVE_MAX_S, own if own is not None else 0.0))


class Call:
    """One request, from admission to its one `request.completed`: where it went and what it used."""

    __slots__ = ("gw", "who", "op", "job", "route", "spec", "started", "created", "streamed", "trace", "admission",
                 "stream", "engine_id", "node_id", "route_reason", "parts", "ttft_s", "usage", "status", "http_status",
                 "encoded", "_refresher", "admitted", "_finished", "keep_alive_s",
                 "on_loading", "client_id", "work")

    def __init__(self, gw: Gateway, who: Caller, op: str, job: Any, route: RouteRequest | None = None,
                 keep_alive_s: float | None = None, client_id: str | None = None) -> None:
        """`route`: what the router is asked (the model and op, and a chat's affinity hints and pin);
        `keep_alive_s`: how long the model should then stay loaded idle (Ollama's keep_alive), None: its own;
        `client_id`: the client's own id for it, kept with its usage (None: the HTTP request's
        X-Client-Request-Id)."""
        self.gw, self.who, self.op, self.job = gw, who, op, job
        self.client_id = client_request_id_var.get() if client_id is None else client_id
        self.keep_alive_s = keep_alive_s
        self.on_loading: Callable[[], None] | None = None  # called if the model must first be loaded on demand
        self.route = route or RouteRequest(request_id=job.request_id, model=job.model, op=op)  # type: ignore[arg-type]
        self.spec = OPS[op]
        self.started = time.monotonic()
        self.created = int(time.time())
        self.streamed = bool(getattr(job, "stream", False))
        self.trace = Trace() if tracing.enabled() else NO_TRACE
        self.admission = NOT_ADMITTED
        self.stream: FrameStream | None = None
        self.engine_id = self.node_id = self.route_reason = ""
        self.parts = 0
        self.ttft_s: float | None = None
        self.usage = Usage()
        self.work: Work | None = None  # an image or video job's pixels x steps, billed once an engine took it
        self.status, self.http_status = "ok", 200
        self.encoded: bytes | None = None  # the job as sent, once measured
        self._refresher: asyncio.Task | None = None
        self.admitted = False
        self._finished = False

    @property
    def cfg(self) -> ModelConfig:
        assert self.admission.cfg is not None, "the call is not admitted yet"
        return self.admission.cfg

    @property
    def request_id(self) -> str:
        return self.job.request_id

    def bus_headers(self) -> dict[str, str]:
        headers = {HDR_REQUEST_ID: self.job.request_id, HDR_KEY_NAME: self.who.key_name}
        if self.keep_alive_s is not None:
            headers[HDR_KEEP_ALIVE] = repr(self.keep_alive_s)
        return headers

    def response_headers(self) -> dict[str, str]:
        engine = self.engine_id
        if engine and "admin" not in self.who.scopes:  # a node's id (often its host name) is the operator's to see
            engine = ",".join(seal.sealer().handle(e) for e in engine.split(","))
        return {HDR_REQUEST_ID: self.job.request_id, ENGINE_HEADER: engine, ROUTE_HEADER: self.route_reason}

    # --- the steps -------------------------------------------------------------------------------------

    async def admit(self) -> ModelConfig:
        """The model (serving this op), a body the bus can carry, then the key's limits: nothing is reserved for
        a request refused by the first two."""
        allowed(self.who, self.job.model)  # first: a model outside the key's allow-list is as absent as a missing one
        cfg = await self.gw.find_model(self.job.model, self.op)
        allowed(self.who, cfg.name, cfg.owner)  # another key's fine-tuned model is as absent, too
        if self.keep_alive_s is not None and "admin" not in self.who.scopes:
            self.keep_alive_s = tenant_keep_alive(cfg, self.keep_alive_s)
        key = self.who.key
        if self.spec.llm and (cfg.default_output_tokens or cfg.max_output_tokens or cfg.stop or (
                key is not None and (key.default_output_tokens or key.max_output_tokens))):
            self.job = output_limited(self.job, cfg, key)
        if self.spec.llm and hasattr(self.job, "priority"):
            self.job = prioritised(self.job, priority_var.get())
        if self.spec.llm:
            self.scope_cache(cfg)
            check_schemas(self.job)  # a grammar's cost grows with its schema's nesting: bounded before it is built
        if not self.spec.llm:  # an image's or video's pixels x steps within the model's limits, priced before any GPU works
            self.work = checked_work(cfg, self.job)
        if not self.spec.blobs:  # measured by encoding it once: the bytes are what is sent
            self.encoded = self.check_size(self.job)
        self.admission = await self.gw.accounts.admit(self.who, cfg, self.job)
        self.admitted = True
        if self.trace is not NO_TRACE:
            self.trace.start(self.spec.span, request_id=self.job.request_id, model=self.job.model, op=self.op,
                             key_name=self.who.key_name, stream=self.streamed)
        if self.admission.held is not None:
            self._refresher = asyncio.create_task(self._refresh(self.admission.held))
        return cfg

    def scope_cache(self, cfg: ModelConfig) -> None:
        """Unless this key may share the model's prompt cache, its affinity keys and its job carry the key's scope:
        the router never sends it after another key's prefix, nor does an engine serve it from one."""
        key = self.who.key
        scope = affinity.cache_scope(self.who.key_name, cfg.share_cache, key.share_cache if key else None,
                                     self.gw.settings.share_cache)
        if scope:
            self.route = affinity.scoped(self.route, scope)
            if hasattr(self.job, "cache_scope"):
                self.job = msgspec.structs.replace(self.job, cache_scope=scope)

    def check_size(self, job: Any) -> bytes:
        """The job encoded for the bus; over what one message carries it is the client's 413, not a 500 from the
        publish."""
        data = self.spec.subject.encode(job)
        limit = self.gw.bus.nc.max_payload - HEADROOM
        if len(data) > limit:
            raise ApiError(413, f"The request is too large: {len(data)} bytes of job, and one message carries at "
                                f"most {limit}.", code="request_too_large")
        return data

    async def open(self, *, stream: bool = False) -> Chunk | Final:
        """The first frame: the merged answer of a fan-out, or one engine's first frame. `stream`: send the job
        streamed when it goes to one engine (speech: bytes as they come, while a fan-out answers whole)."""
        try:
            decision = None
            if self.spec.fanout and self.cfg.distribute.enabled and not self.streamed:
                final, decision = await self._fan_out()
                if final is not None:
                    return final
            job = self.job
            if stream:
                job = self.job = msgspec.structs.replace(job, stream=True)
                self.streamed = True
                self.encoded = None
            if not self.spec.llm:
                job = await self.gw.blobs.pack(job)
                if self.spec.blobs:
                    self.encoded = self.check_size(job)
                elif job is not self.job:
                    self.encoded = None
            self.stream, first, decision = await self.gw.relay.first_frame(
                self.op, job, self.route, self.trace, self.bus_headers(), decision, self.encoded, self.on_loading)
        except BaseException as exc:
            raise await self.fail(exc) from None
        self.engine_id, self.node_id, self.route_reason = decision.engine_id, decision.node_id, decision.reason
        self.ttft_s = time.monotonic() - self.started
        return first

    async def _fan_out(self) -> tuple[Final | None, RouteDecision | None]:
        """Split the job over the workers holding its model when two or more hold it and its plan splits it:
        the merged `Final`. Otherwise (None, the route decision to reuse for the single engine)."""
        decision = await self.gw.relay.route(self.route, [], self.bus_headers())
        plan = None
        if decision.holders >= 2:  # transcription and OCR plans decode the upload: off the event loop
            plan = await asyncio.to_thread(plans.plan, self.op, self.job, decision.holders, self.cfg.distribute)
        if plan is None:
            return None, decision
        self.route_reason, self.parts = "fanout", len(plan.jobs)
        try:
            final = await scatter(self.gw, self.op, self.job, plan, self.bus_headers())
        except (NatsError, BusError) as exc:
            if isinstance(exc, BusError) and not exc.retryable:
                raise
            # the WORK stream takes no parts now (its RAFT group elects a leader for seconds after a head died), or
            # this gateway's connection to the bus dropped under the parts (it reconnects to another server at
            # once): splitting is a speed-up, so the whole job goes to one engine instead of failing
            log.info("request %s: the work queue took no parts (%s); sent whole to one engine",
                     self.job.request_id, getattr(exc, "message", "") or exc or type(exc).__name__)
            self.route_reason, self.parts = "", 0
            return None, decision
        self.engine_id = final.engine_id
        self.ttft_s = time.monotonic() - self.started
        return final, None

    async def queued(self, send: Callable[[Any, dict[str, str]], Awaitable[Final]]) -> Final:
        """The whole answer when the job runs as one part on the `WORK` queue instead of through `open` (a batch
        line: whichever holder of the model pulls it runs it, and a part whose worker dies is redelivered).
        `send(job, headers)` publishes it and waits for its `Final`. Admitted first (raising the refusal, with
        nothing to account), then accounted once, its output's blobs inline."""
        if not self.admitted:
            await self.admit()
        self.route_reason, self.parts = "batch", 1
        try:
            job = self.job if self.spec.llm else await self.gw.blobs.pack(self.job)
            final = await send(job, self.bus_headers())
            self.engine_id, self.ttft_s = final.engine_id, time.monotonic() - self.started
            if final.output is not None:
                final = msgspec.structs.replace(final, output=await self.gw.blobs.unpack(final.output))
        except BaseException as exc:
            raise await self.fail(exc) from None
        await self.finish(final)
        return final

    async def next(self) -> Chunk | Final:
        """The frame after the first ones; an engine's error is raised as a BusError."""
        frame = await next_frame(self.stream)  # type: ignore[arg-type]
        if isinstance(frame, ErrorReply):
            raise BusError.from_reply(frame)
        return frame

    # --- the end, exactly once ---------------------------------------------------------------------------

    async def finish(self, final: Final | None = None, usage: Usage | None = None) -> None:
        """Account once: the usage (of `final`), the key's charges, `request.completed`."""
        if self._finished:
            return
        self._finished = True
        if self._refresher is not None:
            self._refresher.cancel()
        if self.stream is not None:
            self.stream.close()
        if final is not None:
            self.usage = final.usage
        if usage is not None:
            self.usage = usage
        if self.admitted and self.usage != _NO_USAGE:
            self.usage = self._checked(self.usage)
        done = RequestCompleted(
            request_id=self.job.request_id, ts=time.time(), key_name=self.who.key_name, model=self.job.model,
            op=self.op, status=self.status, http_status=self.http_status, engine_id=self.engine_id,  # type: ignore[arg-type]
            node_id=self.node_id, duration_s=time.monotonic() - self.started, ttft_s=self.ttft_s,
            prompt_tokens=self.usage.prompt_tokens, completion_tokens=self.usage.completion_tokens,
            stream=self.streamed, route_reason=self.route_reason, cost_usd=price(self.cfg, self.usage, self._billed_work()), parts=self.parts,
            client_request_id=self.client_id)
        await self.gw.accounts.finish(self.who, self.admission, done, self.trace)

    def _billed_work(self) -> Work | None:
        """The image or video work to bill: all of it once an engine gave an answer, or took the job and was then
        left by its client (the GPU was given to it either way); none for a job refused or failed."""
        if self.admitted and (self.status == "ok" or (self.status == "cancelled" and self.engine_id)):
            return self.work
        return None

    def _checked(self, usage: Usage) -> Usage:
        """The usage an engine reported, as far as this request could have used it: what a node says it used is
        billed only within what the gateway saw (never negative, never past max_tokens or the context), and
        anything beyond is logged as the node's fault."""
        def size() -> int:
            return len(self.encoded) if self.encoded is not None else len(self.spec.subject.encode(self.job))

        prompt_most, completion_most = usage_ceiling(self.cfg, self.job, self.spec.llm, size, usage.prompt_tokens)
        checked, why = checked_usage(usage, prompt_most, completion_most)
        if why:
            log.warning("node fault: engine %s of node %s reported impossible usage (%s); billed %d + %d tokens",
                        self.engine_id or "?", self.node_id or "?", why, checked.prompt_tokens,
                        checked.completion_tokens, extra={"request_id": self.job.request_id})
        return checked

    def finish_detached(self, final: Final | None = None) -> None:
        """`finish`, as a task of its own (from a stream whose task may be being cancelled)."""
        self.gw.relay.spawn(self.finish(final))

    def abandon(self) -> None:
        """The client went away: stop the engine, and still account (detached from the cancelled task). Logged
        once, at INFO: a client leaving is no fault of the gateway's (no traceback, no warning)."""
        if not self._finished and self.status != "cancelled":
            log.info("client disconnected", extra={"request_id": self.job.request_id, "fields": {
                "op": self.op, "model": self.job.model, "stream": self.streamed, "first_frame": self.ttft_s is not None,
                "waited_ms": round((time.monotonic() - self.started) * 1000, 1)}})
        self.status, self.http_status = "cancelled", 499
        if self.stream is not None:
            self.gw.relay.spawn(self.stream.cancel())
        self.finish_detached()

    async def fail(self, exc: BaseException) -> BaseException:
        """Account for a call that ends in `exc`; what to raise in its place (the client's ApiError)."""
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            self.abandon()
            return exc
        if isinstance(exc, BusError):
            err = from_bus(exc, self.gw.settings.retry_after_s)
        elif isinstance(exc, NatsError):  # a publish not acked (NATS restarting, JetStream out of disk)
            log.warning("request %s: the message bus did not take it: %s", self.job.request_id, exc)
            err = ApiError(503, "The cluster could not take the request just now; try again shortly.",
                           type="service_unavailable", code="bus_unavailable",
                           headers={"Retry-After": str(self.gw.settings.retry_after_s)})
        else:
            err = exc
        if isinstance(err, ApiError):
            self.status, self.http_status = err.code or "error", err.status
        else:
            self.status, self.http_status = "error", 500
        await self.finish()
        return err

    async def _refresh(self, held: Reservation) -> None:
        while True:
            await asyncio.sleep(REFRESH_EVERY_S)
            try:
                await self.gw.accounts.refresh(held)
            except Exception as exc:  # noqa: BLE001 - Redis blinked: the next tick tries again
                log.warning("could not refresh the budget reservation of %s: %s", self.job.request_id, exc)


# --- adapters: the shapes of an answer ---------------------------------------------------------------------


async def answer(call: Call, request: Request | None = None,
                 on_chunk: Callable[[Chunk], Awaitable[None]] | None = None) -> Final:
    """The whole answer, its output's blobs inline, accounted once. With `request`, a client that disconnects
    while it waits cancels the engine job (and the call is accounted as cancelled)."""
    if request is None:
        return await _whole(call, on_chunk)
    return await until_disconnect(request, _whole(call, on_chunk))


async def _whole(call: Call, on_chunk: Callable[[Chunk], Awaitable[None]] | None) -> Final:
    if not call.admitted:
        await call.admit()
    frame = await call.open()
    try:
        while not isinstance(frame, Final):
            if on_chunk is not None:
                await on_chunk(frame)
            frame = await call.next()
        if frame.output is not None:
            frame = msgspec.structs.replace(frame, output=await call.gw.blobs.unpack(frame.output))
    except BaseException as exc:
        raise await call.fail(exc) from None
    await call.finish(frame)
    return frame


def relay_stream(call: Call, first: Chunk | Final, chunk: Callable[[Chunk], bytes],
                 final: Callable[[Final], Awaitable[bytes]],
                 error: Callable[[ApiError], bytes] | None = None) -> AsyncIterator[bytes]:
    """The frames relayed as they come, each chunk as `chunk` shapes it (an SSE event, audio bytes) and the end
    as `final` does. Headers are gone by the time an engine fails mid-stream: `error` renders the failure as a
    last piece (SSE's error event); without it the stream is cut. A client that leaves cancels the engine job.
    Accounted once, in every case."""

    async def pieces() -> AsyncIterator[bytes]:
        last: Final | None = None
        ended = False
        frame: Any = first
        stream = call.stream
        try:
            while not isinstance(frame, Final):  # per token: `Call.next` inlined
                yield chunk(frame)
                frame = await next_frame(stream)  # type: ignore[arg-type]
                if isinstance(frame, ErrorReply):
                    raise BusError.from_reply(frame)
            last, ended = frame, True
            tail = await final(frame)
            # accounted before the last bytes go out: its event is journalled, so a gateway killed once the client
            # has the whole answer still has it billed (the next gateway to start sends it); shielded, so a client
            # leaving now does not cut the accounting short (the `finally` below finds it done)
            await asyncio.shield(call.finish(frame))
            yield tail
        except BusError as exc:
            err = from_bus(exc, call.gw.settings.retry_after_s)
            call.status, call.http_status = err.code or "error", err.status
            ended = True
            if error is None:
                raise err from None
            yield error(err)
        finally:
            if not ended:  # the client went away mid-stream (or the stream broke): stop the engine
                call.abandon()
            else:  # may run while the stream's task is being cancelled: detached
                call.finish_detached(last)

    return pieces()


LOADING_KEEPALIVE_S = 5.0  # between the comments of a stream that waits for its model to load


async def open_stream(call: Call, request: Request, chunk: Callable[[Chunk], bytes],
                      final: Callable[[Final], Awaitable[bytes]], error: Callable[[ApiError], bytes],
                      comment: bytes | None) -> AsyncIterator[bytes]:
    """Admit, open and `relay_stream`. Errors before the first frame are the client's status code, except while
    the model loads on demand with a `comment` (an SSE comment): then the stream starts at once with it, repeated
    every `LOADING_KEEPALIVE_S` so clients and proxies do not time out, and a failure comes as `error`."""
    await call.admit()
    if comment is None:
        return relay_stream(call, await until_disconnect(request, call.open()), chunk, final, error)
    loading = asyncio.Event()
    call.on_loading = loading.set
    opening = asyncio.ensure_future(call.open())
    told = asyncio.ensure_future(loading.wait())
    try:
        await until_disconnect(request, asyncio.wait({opening, told}, return_when=asyncio.FIRST_COMPLETED))
    except (asyncio.CancelledError, ClientGone):
        opening.cancel()
        raise
    finally:
        told.cancel()
    if opening.done():
        return relay_stream(call, opening.result(), chunk, final, error)

    async def pieces() -> AsyncIterator[bytes]:
        try:
            yield comment  # the response starts now, while the model loads
            while not (await asyncio.wait({opening}, timeout=LOADING_KEEPALIVE_S))[0]:
                yield comment
            try:
                first = opening.result()
            except ApiError as err:
                yield error(err)
                return
            async for piece in relay_stream(call, first, chunk, final, error):
                yield piece
        finally:
            if not opening.done():
                opening.cancel()

    return pieces()
