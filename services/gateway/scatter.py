"""Fan-out, gateway side: publish a plan's parts to the `WORK` queue, gather their answers, merge them.

Each part gets an inbox of its own, so answers are told apart by where they arrive; a part whose worker dies
is redelivered by JetStream to another holder and answered there. A part nobody answers within
`part_timeout_s` (every delivery died) or that failed on its last delivery fails the request, naming the part.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from coderai.contracts import BusError, ErrorReply, Final, WorkPart, encode, model_key
from coderai.contracts.subjects import WORK_PART
from coderai.gateway import fanout_plans
from coderai.gateway.relay import next_frame
from coderai.runtime.bus import FrameStream


async def scatter(gw: Any, op: str, job: Any, plan: fanout_plans.Plan, headers: dict[str, str]) -> Final:
    """Run every part of `plan` on whichever workers pull them; the merged answer as one `Final`."""
    n = len(plan.jobs)
    streams: list[FrameStream] = []
    subject = WORK_PART(model_key=model_key(job.model), op=op)
    try:
        for i, sub in enumerate(plan.jobs):
            sub = await gw.blobs.pack(sub)
            stream, reply = await gw.bus.expect_stream(gw.settings.part_timeout_s)
            streams.append(stream)
            part = WorkPart(request_id=job.request_id, model=job.model, op=op, part=i, parts=n, reply=reply,  # type: ignore[arg-type]
                            job=msgspec.Raw(encode(sub)))
            await gw.bus.js.publish(subject, encode(part), headers=headers)
        finals = await asyncio.gather(*(_final(s, i, n, gw.settings.part_timeout_s) for i, s in enumerate(streams)))
    finally:
        for s in streams:
            s.close()
    outputs = [await gw.blobs.unpack(f.output) for f in finals]
    output, usage = fanout_plans.merge(op, job, plan, outputs, [f.usage for f in finals])
    engines = sorted({f.engine_id for f in finals})
    return Final(seq=0, engine_id=",".join(engines), output=output, usage=usage,
                 ttft_s=min((f.ttft_s for f in finals if f.ttft_s is not None), default=None))


async def _final(stream: FrameStream, i: int, n: int, timeout_s: float) -> Final:
    """Part `i`'s final frame; its error (or silence) as a BusError that names the part."""
    try:
        while True:
            frame = await next_frame(stream)
            if isinstance(frame, Final):
                return frame
            if isinstance(frame, ErrorReply):
                raise BusError(frame.code, f"part {i + 1} of {n} failed: {frame.message}", False, frame.param)
    except BusError as exc:
        if exc.retryable:  # silence or a lost bus: nobody is answering this part any more
            raise BusError("engine_failed", f"part {i + 1} of {n} was not answered within {timeout_s:.0f}s "
                                            "(every worker it went to stopped)", False) from None
        raise
