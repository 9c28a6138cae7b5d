"""Fan-out, gateway side: publish a plan's parts to the `WORK` queue, gather their answers, merge them.

Each part gets an inbox of its own, so answers are told apart by where they arrive; a part whose worker dies
is redelivered by JetStream to another holder and answered there. A part nobody answers within
`part_timeout_s` while no other part is heard from either (its workers died) or that failed on its last
delivery fails the request, naming the part.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
from nats.errors import Error as NatsError

from coderai.contracts import BusError, ErrorReply, Final, Frame, WorkPart, encode, model_key
from coderai.contracts.jobs import EngineOp
from coderai.contracts.subjects import WORK_PART
from coderai.contracts.topology import WORK
from coderai.contracts.work import work_consumer
from coderai.gateway.fanout import plans
from coderai.runtime.bus import FrameStream, Silence

if TYPE_CHECKING:
    from coderai.gateway.state import Gateway

log = logging.getLogger("coderai.gateway")

PUBLISH_TIMEOUT_S = 2.0
STALL_S = 0.5  # no part heard from this long: is the queue moving at all? (a worker says so in milliseconds)
INFO_TIMEOUT_S = 0.5  # a consumer with a leader says how it is in milliseconds
SLOW_S = 2.0  # a fan-out slower than this is logged (a queue that stalled: a head's death, workers all busy)


async def scatter(gw: Gateway, op: EngineOp, job: Any, plan: plans.Plan, headers: dict[str, str]) -> Final:
    """Run every part of `plan` on whichever workers pull them; the merged answer as one `Final`."""
    n = len(plan.jobs)
    streams: list[FrameStream] = []
    subject = WORK_PART(model_key=model_key(job.model), op=op)
    consumer = work_consumer(job.model, op)
    t0 = time.monotonic()
    try:
        for i, sub in enumerate(plan.jobs):
            sub = await gw.blobs.pack(sub)
            stream, reply = await gw.bus.expect_stream(gw.settings.part_timeout_s / 2)  # wakes to check siblings
            streams.append(stream)
            part = WorkPart(
                request_id=job.request_id,
                model=job.model,
                op=op,
                part=i,
                parts=n,
                reply=reply,
                job=msgspec.Raw(encode(sub)),
            )
            # a healthy stream acks in milliseconds; one whose leader died with its head does not for seconds, and
            # the caller sends the job whole to one engine sooner than it would elect one
            try:
                await gw.bus.js.publish(subject, encode(part), headers=headers, timeout=PUBLISH_TIMEOUT_S)
            except (NatsError, TimeoutError) as exc:
                gw.queue_gate.failed(consumer, str(exc) or type(exc).__name__)
                raise
        queued = time.monotonic()
        activity, heard = [queued], [False] * n
        gathered = asyncio.gather(
            *(_final(s, i, n, gw.settings.part_timeout_s, activity, heard) for i, s in enumerate(streams))
        )
        try:
            finals = await _unless_stalled(gw, consumer, gathered, activity, heard)
        finally:
            gathered.cancel()
    finally:
        for s in streams:
            s.close()
    if (took := time.monotonic() - t0) > SLOW_S:
        log.info("request %s: its %d parts took %.1f s (%.1f s to queue them)", job.request_id, n, took, queued - t0)
    outputs = [await gw.blobs.unpack(f.output) for f in finals]
    try:
        output, usage = plans.merge(op, job, plan, outputs, [f.usage for f in finals])
    except plans.MergeError as exc:  # engines answered parts in shapes that do not fit together
        raise BusError("engine_failed", f"the parts' answers could not be merged: {exc}") from None
    engines = sorted({f.engine_id for f in finals})
    return Final(
        seq=0,
        engine_id=",".join(engines),
        output=output,
        usage=usage,
        ttft_s=min((f.ttft_s for f in finals if f.ttft_s is not None), default=None),
    )


async def _unless_stalled(
    gw: Gateway, consumer: str, gathered: asyncio.Future[list[Final]], activity: list[float], heard: list[bool]
) -> list[Final]:
    """What `gathered` gives; a retryable `no_engine` BusError (the caller sends the job whole to one engine) once
    no part was heard from for `STALL_S` (a worker says so the moment it takes a part, then answers or keeps alive
    each second) and either the shared consumer does not answer (its leader died with a NATS server and its RAFT
    group elects another, for seconds) or it holds none of the parts though one was never heard from (delivered to
    a worker's pull request that was lost with that server: JetStream hands it out again only after the ack wait).
    A consumer that still holds parts is busy (every holder runs other parts): they wait their turn."""
    while True:
        done, _ = await asyncio.wait({gathered}, timeout=STALL_S)
        if done:
            return gathered.result()
        if time.monotonic() - activity[0] < STALL_S:
            continue
        try:
            async with asyncio.timeout(INFO_TIMEOUT_S):
                info = await gw.bus.js.consumer_info(WORK.name, consumer)
        except (NatsError, TimeoutError) as exc:
            why = str(exc) or type(exc).__name__
            gw.queue_gate.failed(consumer, why)
            raise BusError("no_engine", f"the work queue {consumer} does not move ({why})", True) from None
        if not info.num_pending and not all(heard):
            raise BusError("no_engine", "a part of this request went to a worker that never took it", True)


async def _final(
    stream: FrameStream, i: int, n: int, timeout_s: float, activity: list[float], heard: list[bool]
) -> Final:
    """Part `i`'s final frame; its error as a BusError that names the part. A part may wait in the queue while
    other parts run, so it is given up on only when no part of the request has been heard for `timeout_s`."""
    while True:
        try:
            frame = await stream.next(Frame)
        except BusError as exc:
            if not isinstance(exc, Silence):  # an engine's error, or this gateway's own connection to the bus lost
                raise
            if time.monotonic() - activity[0] < timeout_s:
                continue  # this part is still queued, but its siblings are being answered
            raise BusError(
                "engine_failed",
                f"part {i + 1} of {n} was not answered within {timeout_s:.0f}s (every worker it went to stopped)",
                False,
            ) from None
        activity[0], heard[i] = time.monotonic(), True
        if isinstance(frame, Final):
            return frame
        if isinstance(frame, ErrorReply):
            raise BusError(frame.code, f"part {i + 1} of {n} failed: {frame.message}", False, frame.param)
