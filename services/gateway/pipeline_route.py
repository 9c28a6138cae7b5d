"""The pipeline's second stage: where the job runs, up to its first frame. Split over the workers holding the
model (a fan-out, answered whole, falling back to one engine when the work queue takes no parts), else picked by
the router and sent to one engine, failing over to another before its first frame (the relay's `first_frame`); a
batch line instead goes whole, as one part, on the `WORK` queue. Then the frames after the first.

`Call.open`, `Call.queued` and `Call.next` run these; an error is accounted (`Call.fail`) and raised as
the client's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from nats.errors import Error as NatsError

from coderai.contracts import BusError, Chunk, ErrorReply, Final, RouteDecision
from coderai.contracts.work import work_consumer
from coderai.gateway.fanout import plans
from coderai.gateway.fanout.scatter import scatter
from coderai.gateway.pipeline_admit import check_size
from coderai.gateway.frames import next_frame

if TYPE_CHECKING:
    from coderai.gateway.pipeline import Call

log = logging.getLogger("coderai.gateway")


async def open_first(call: Call, stream: bool = False) -> Chunk | Final:
    """The first frame: the merged answer of a fan-out, or one engine's first frame. `stream`: send the job
    streamed when it goes to one engine (speech: bytes as they come, while a fan-out answers whole)."""
    try:
        decision = None
        if call.spec.fanout and call.cfg.distribute.enabled and not call.streamed:
            final, decision = await _fan_out(call)
            if final is not None:
                return final
        job = call.job
        if stream:
            job = call.job = msgspec.structs.replace(job, stream=True)
            call.streamed = True
            call.encoded = None
        if not call.spec.llm:
            job = await call.gw.blobs.pack(job)
            if call.spec.blobs:
                call.encoded = check_size(call, job)
            elif job is not call.job:
                call.encoded = None
        call.stream, first, decision = await call.gw.relay.first_frame(
            call.op, job, call.route, call.trace, call.bus_headers(), decision, call.encoded, call.on_loading
        )
    except BaseException as exc:
        raise await call.fail(exc) from None
    call.engine_id, call.node_id, call.route_reason = decision.engine_id, decision.node_id, decision.reason
    call.ttft_s = time.monotonic() - call.started
    return first


async def _fan_out(call: Call) -> tuple[Final | None, RouteDecision | None]:
    """Split the job over the workers holding its model when two or more hold it and its plan splits it:
    the merged `Final`. Otherwise (None, the route decision to reuse for the single engine)."""
    decision = await call.gw.relay.route(call.route, [], call.bus_headers())
    plan = None
    # a queue that took no parts lately (fanout/gate.py): whole to one engine at once, with no plan made for it
    if decision.holders >= 2 and call.gw.queue_gate.open(work_consumer(call.job.model, call.op)):
        # transcription and OCR plans decode the upload: off the event loop
        plan = await asyncio.to_thread(plans.plan, call.op, call.job, decision.holders, call.cfg.distribute)
    if plan is None:
        return None, decision
    call.route_reason, call.parts = "fanout", len(plan.jobs)
    try:
        final = await scatter(call.gw, call.op, call.job, plan, call.bus_headers())
    except (NatsError, BusError) as exc:
        if isinstance(exc, BusError) and not exc.retryable:
            raise
        # the WORK stream takes no parts now (its RAFT group elects a leader for seconds after a head died), or
        # this gateway's connection to the bus dropped under the parts (it reconnects to another server at
        # once): splitting is a speed-up, so the whole job goes to one engine instead of failing
        log.info(
            "request %s: the work queue took no parts (%s); sent whole to one engine",
            call.job.request_id,
            getattr(exc, "message", "") or exc or type(exc).__name__,
        )
        call.route_reason, call.parts = "", 0
        return None, decision
    call.engine_id = final.engine_id
    call.ttft_s = time.monotonic() - call.started
    return final, None


async def queued(call: Call, send: Callable[[Any, dict[str, str]], Awaitable[Final]]) -> Final:
    """The whole answer when the job runs as one part on the `WORK` queue instead of through `open` (a batch
    line: whichever holder of the model pulls it runs it, and a part whose worker dies is redelivered).
    `send(job, headers)` publishes it and waits for its `Final`. Admitted first (raising the refusal, with
    nothing to account), then accounted once, its output's blobs inline."""
    if not call.admitted:
        await call.admit()
    call.route_reason, call.parts = "batch", 1
    try:
        job = call.job if call.spec.llm else await call.gw.blobs.pack(call.job)
        final = await send(job, call.bus_headers())
        call.engine_id, call.ttft_s = final.engine_id, time.monotonic() - call.started
        final = await call.unpacked(final)
    except BaseException as exc:
        raise await call.fail(exc) from None
    await call.finish(final)
    return final


async def next_after(call: Call) -> Chunk | Final:
    """The frame after the first ones; an engine's error is raised as a BusError."""
    assert call.stream is not None  # the frames before came on it (a fan-out's answer is one Final)
    frame = await next_frame(call.stream)
    if isinstance(frame, ErrorReply):
        raise BusError.from_reply(frame)
    return frame
