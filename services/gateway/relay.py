"""The data path: ask the router, send the job to the engine, relay frames; fail over before the first token."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from coderai.contracts import (
    BusError,
    CancelJob,
    Chunk,
    ErrorReply,
    Final,
    RouteDecision,
    RouteRequest,
    model_key,
)
from coderai.contracts.ops import ENGINE_OPS
from coderai.contracts.pods import EscalateReply, EscalateRequest
from coderai.contracts.subjects import CMD_SCHEDULER_ESCALATE, ENGINE_CANCEL, EVT_ENGINE_READY, ROUTE_PICK
from coderai.gateway.frames import next_frame
from coderai.gateway.settings import GatewaySettings
from coderai.runtime import tracing
from coderai.runtime.bus import Bus, FrameStream, Silence
from coderai.runtime.tracing import NO_SPAN

if TYPE_CHECKING:
    from coderai.gateway.accounting import Trace
    from coderai.gateway.picker import Picker

log = logging.getLogger("coderai.gateway")

REASK_S = 2.0
"""A request waiting after an escalation asks the router again when a router announces an engine of its model
(`EngineReady`), and at the latest this long after it last asked: an announcement is not stored for a subscriber
that was reconnecting, and a busy engine that frees up is announced by nobody."""


class Relay:
    def __init__(self, bus: Bus, settings: GatewaySettings, picker: Picker | None = None) -> None:
        self.bus = bus
        self.settings = settings
        self.picker = picker  # the router's pick made here when its copy is whole (gateway/picker.py)
        self._background: set[asyncio.Task] = set()

    async def route(self, req: RouteRequest, tried: list[str], headers: dict[str, str]) -> RouteDecision:
        """The router's pick for `req` (the request's model, op and affinity hints), without the engines `tried`:
        made here from this gateway's copy when it can, else asked of the router."""
        if tried:
            req = msgspec.structs.replace(req, exclude=tried)
        if self.picker is not None:
            if (decision := self.picker.pick(req, headers)) is not None:
                return decision
            self.picker.asked += 1
        for ask in range(2):
            try:
                return await self.bus.request(ROUTE_PICK, req, timeout=self.settings.route_timeout_s, headers=headers)
            except BusError as exc:
                if exc.code != "timeout":
                    raise
            if ask or not self.bus.nc.is_connected:  # once more: a router that did not run for a moment answers
                break
        # none in time (a nats-server died under the request, the routers reconnect): the cluster's moment, not the
        # client's fault: a 503 with Retry-After, not a 504, nor "no engine" (which would load the model, rent a pod)
        why = f"no router answered within {self.settings.route_timeout_s:g} s; try again shortly"
        raise BusError("overloaded", why, retryable=True)

    async def _pick(
        self, req: RouteRequest, tried: list[str], headers: dict[str, str], on_loading: Callable[[], None] | None = None
    ) -> RouteDecision:
        """The router's pick; with no engine, or only busy ones, the scheduler is asked to escalate: it loads a
        model that is not loaded on demand, or rents a pod for one that may burst, and the request waits (bounded)
        for that engine."""
        try:
            decision = await self.route(req, tried, headers)
        except BusError as exc:
            if exc.code != "no_engine" or tried or req.pin:  # a pinned engine that is not there is final
                raise
            return await self._escalate(req, headers, "no_engine", exc, on_loading)
        if decision.busy and not tried and not req.pin:
            return await self._escalate(req, headers, "busy", decision)
        return decision

    async def _escalate(
        self,
        req: RouteRequest,
        headers: dict[str, str],
        reason: Literal["no_engine", "busy"],
        fallback: RouteDecision | BusError,
        on_loading: Callable[[], None] | None = None,
    ) -> RouteDecision:
        """Ask for a pod or a load; then ask the router again, each time a router announces an engine of the model,
        until an engine (a non-busy one, for `busy`) can take the job. Without one in time: the busy engine after
        all, or the original `no_engine`. `on_loading` is called when the model is being loaded on demand (a
        streamed answer starts its keep-alives then)."""
        announced = asyncio.Event()

        async def on_ready(_e: object, _m: object) -> None:
            announced.set()

        # listening before the scheduler is asked: the engine it starts cannot be announced before this hears it
        sub = await self.bus.listen(
            EVT_ENGINE_READY, on_ready, subject_str=EVT_ENGINE_READY(model_key=model_key(req.model))
        )
        try:
            return await self._escalated(req, headers, reason, fallback, announced, on_loading)
        finally:
            with contextlib.suppress(Exception):  # the bus may be closing: the subscription goes with it
                await sub.unsubscribe()

    async def _escalated(
        self,
        req: RouteRequest,
        headers: dict[str, str],
        reason: Literal["no_engine", "busy"],
        fallback: RouteDecision | BusError,
        announced: asyncio.Event,
        on_loading: Callable[[], None] | None,
    ) -> RouteDecision:
        try:
            reply = await self.bus.request(
                CMD_SCHEDULER_ESCALATE,
                EscalateRequest(model=req.model, reason=reason),
                timeout=self.settings.route_timeout_s + 15.0,
                headers=headers,
            )
        except BusError as exc:
            log.warning("escalation of %s not answered: %s", req.model, exc.message)
            reply = EscalateReply(action="refused", code="no_engine", why=exc.message)
        if reply.action == "refused":
            if isinstance(fallback, RouteDecision):
                return fallback
            if reply.code == "over_budget":
                raise BusError("over_budget", reply.why)
            raise BusError("no_engine", f"{fallback.message}; {reply.why}" if reply.why else fallback.message, True)
        if reply.action == "loading":
            log.info("%s is not loaded: a node loads it on demand", req.model)
            wait_s = self.settings.load_wait_s
            if on_loading is not None:
                on_loading()
        else:
            log.info("escalated %s (%s): pod %s is %s", req.model, reason, reply.pod, reply.action)
            wait_s = self.settings.escalate_wait_s
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            announced.clear()  # an announcement from here on is one the answer below may not have seen
            try:
                decision = await self.route(req, [], headers)
                if not isinstance(fallback, RouteDecision) or not decision.busy:
                    return decision
            except BusError as exc:
                if exc.code != "no_engine":
                    raise
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(announced.wait(), min(REASK_S, max(0.0, left)))
        if isinstance(fallback, RouteDecision):
            return fallback
        what = "is still loading" if reply.action == "loading" else "has a pod starting"
        raise BusError("no_engine", f"model {req.model!r} {what}; try again shortly", True)

    async def _open(
        self, op: str, job: Any, decision: RouteDecision, headers: dict[str, str], encoded: bytes | None
    ) -> FrameStream:
        async def cancel() -> None:
            await self.bus.publish(
                ENGINE_CANCEL,
                CancelJob(request_id=job.request_id),
                node_id=decision.node_id,
                engine_id=decision.engine_id,
            )

        return await self.bus.open_stream(
            ENGINE_OPS[op],
            job,
            idle_timeout_s=self.settings.idle_timeout_s,
            first_timeout_s=self.settings.accept_timeout_s,
            headers=headers,
            on_cancel=cancel,
            encoded=encoded,
            node_id=decision.node_id,
            engine_id=decision.engine_id,
        )

    async def first_frame(
        self,
        op: str,
        job: Any,
        route: RouteRequest,
        trace: Trace,
        headers: dict[str, str],
        first: RouteDecision | None = None,
        encoded: bytes | None = None,
        on_loading: Callable[[], None] | None = None,
    ) -> tuple[FrameStream, Chunk | Final, RouteDecision]:
        """Route and send the job until an engine produces its first real frame, trying up to `max_attempts`
        engines; an engine that fails retryably before that is excluded and the router asked again. `first`: a
        decision already made for the first attempt; `encoded`: the job, encoded already. The stream, its first
        frame and the engine that sent it."""
        tried: list[str] = []
        last: BusError | None = None
        elsewhere: RouteDecision | None = None  # the router's pick already made for the next attempt
        traced = trace.on
        for attempt in range(1, self.settings.max_attempts + 1):
            try:
                if elsewhere is not None:
                    decision, elsewhere = elsewhere, None
                elif first is not None and attempt == 1:
                    decision = first
                elif traced:
                    with tracing.start_span(
                        "route.pick", parent=trace.span, kind="client", attributes={"coderai.attempt": attempt}
                    ) as span:
                        decision = await self._pick(route, tried, tracing.inject(span, headers), on_loading)
                        span.set_attributes(
                            {"coderai.engine_id": decision.engine_id, "coderai.route_reason": decision.reason}
                        )
                else:
                    decision = await self._pick(route, tried, headers, on_loading)
            except BusError as exc:
                raise (last if last is not None and exc.code == "no_engine" else exc) from None
            if traced:
                trace.engine_span = tracing.start_span(
                    "engine.call",
                    parent=trace.span,
                    kind="client",
                    attributes={"coderai.engine_id": decision.engine_id, "coderai.op": op, "coderai.attempt": attempt},
                )
                stream = await self._open(op, job, decision, tracing.inject(trace.engine_span, headers), encoded)
            else:
                stream = await self._open(op, job, decision, headers, encoded)
            try:
                frame = await self._heard(stream, route, [*tried, decision.engine_id], headers, job.model)
                if isinstance(frame, ErrorReply):
                    raise BusError.from_reply(frame)
                return stream, frame, decision
            except asyncio.CancelledError:  # the caller went away while the engine works (a whole answer waits
                await stream.cancel()  # here for all of it): stop the engine too
                raise
            except BusError as exc:
                await stream.cancel()
                if traced:  # this attempt's engine call ends here, whether or not another engine is tried
                    tracing.set_error(trace.engine_span, exc.code)
                    trace.engine_span.end()
                    trace.engine_span = NO_SPAN
                if not exc.retryable:
                    raise
                log.warning(
                    "engine %s failed before the first token (%s); trying another", decision.engine_id, exc.message
                )
                if isinstance(exc, _Elsewhere):
                    elsewhere = exc.decision
                tried.append(decision.engine_id)
                last = exc
        assert last is not None
        raise last

    async def _heard(
        self, stream: FrameStream, route: RouteRequest, tried: list[str], headers: dict[str, str], model: str
    ) -> Chunk | Final | ErrorReply:
        """The first real frame of `stream`. An engine that sends nothing within the accept timeout is given up
        (`_Elsewhere`, with the router's next pick) when another engine can take the job. With none (`tried`: those
        already used, this one too), it may be only slow to say it has the job, as a worker starved of CPU by its
        own engine is, so it gets the idle timeout, as an engine that had spoken would: giving it up would fail the
        request. A router that cannot be asked fails the attempt, as the next pick would have."""
        try:
            return await next_frame(stream, self.settings.queue_timeout_s, model)
        except Silence as silence:
            if stream.first_timeout_s >= stream.idle_timeout_s:
                raise
            try:
                other = await self.route(route, tried, headers)
            except BusError as exc:
                if exc.code != "no_engine":
                    raise
            else:
                raise _Elsewhere(silence, other) from None
        log.info("the engine is slow to take the job and no other engine can: waiting for it")
        stream.first_timeout_s = stream.idle_timeout_s
        return await next_frame(stream, self.settings.queue_timeout_s, model)

    def spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        """Run `coro` detached from the request (it may be cancelled), keeping a reference until done."""
        t = asyncio.create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)


class _Elsewhere(Silence):
    """An engine silent past the accept timeout, given up for `decision`: another engine that can take the job."""

    def __init__(self, silence: Silence, decision: RouteDecision) -> None:
        super().__init__(silence.code, silence.message, retryable=True)
        self.decision = decision
