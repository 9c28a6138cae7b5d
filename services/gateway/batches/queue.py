"""A batch line as one part on the `WORK` queue: whichever worker holding the model comes for it runs it (each
runs at most one queued part per op beside its interactive requests), and a part whose worker dies is
redelivered by JetStream to another holder.

The lines of one (model, op) a gateway has on the queue are bounded (`Lane`), so a batch never buries the
queue's other parts (a fan-out's) under thousands of its own; they share the lane's clock of the last answer,
as a fan-out's parts do, to tell a line still queued behind its siblings from one nobody will answer."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import msgspec

from coderai.contracts import BusError, ErrorReply, Final, Frame, WorkPart, encode, model_key
from coderai.contracts.jobs import EngineOp
from coderai.contracts.subjects import WORK_PART
from coderai.runtime.bus import Silence

if TYPE_CHECKING:
    from coderai.gateway.state import Gateway

IN_FLIGHT = 8  # lines of one (model, op) one gateway keeps on the queue, every batch together
QUIET_LINES = 10  # a line unheard for this many part timeouts is lost (its deliveries all died) even while
# its siblings are answered: a running line is never that quiet, its worker sends keep-alives


class Lane:
    """The lines of one (model, op) on the queue: a bound on them, and when one was last heard from."""

    def __init__(self, size: int = IN_FLIGHT) -> None:
        self.slots = asyncio.Semaphore(size)
        self.heard = time.monotonic()


class Lanes:
    def __init__(self) -> None:
        self.lanes: dict[tuple[str, str], Lane] = {}

    def __call__(self, model: str, op: str) -> Lane:
        return self.lanes.setdefault((model, op), Lane())


async def send(gw: Gateway, lane: Lane, op: EngineOp, job: Any, headers: dict[str, str]) -> Final:
    """Publish `job` as a one-part `WorkPart` and wait for its `Final` (its error as a BusError)."""
    timeout_s = gw.settings.part_timeout_s
    stream, reply = await gw.bus.expect_stream(timeout_s / 2)
    try:
        part = WorkPart(
            request_id=job.request_id,
            model=job.model,
            op=op,
            part=0,
            parts=1,
            reply=reply,
            job=msgspec.Raw(encode(job)),
        )
        await gw.bus.js.publish(WORK_PART(model_key=model_key(job.model), op=op), encode(part), headers=headers)
        mine = time.monotonic()
        lane.heard = max(lane.heard, mine)  # a lane idle for long is not taken for a dead one
        while True:
            try:
                frame = await stream.next(Frame)
            except BusError as exc:
                now = time.monotonic()
                if isinstance(exc, Silence) and now - lane.heard < timeout_s and now - mine < QUIET_LINES * timeout_s:
                    continue  # still queued behind the lane's other lines, which are being answered
                if not exc.retryable:
                    raise
                raise BusError(
                    "engine_failed",
                    f"the line was not answered within {now - mine:.0f}s (every worker it went to stopped)",
                    False,
                ) from None
            mine = lane.heard = time.monotonic()
            if isinstance(frame, Final):
                return frame
            if isinstance(frame, ErrorReply):
                raise BusError.from_reply(frame)
    finally:
        stream.close()
