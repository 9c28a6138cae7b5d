"""Fan-out parts: every worker holding a model pulls its parts from the `WORK` work-queue stream.

One durable pull consumer per (model, op) is shared by all holders, so each part goes to one of them and a
faster machine, which comes back for the next part sooner, takes more. A part is acked once it is answered;
while it runs the worker tells JetStream it is still on it, and a part whose worker dies is redelivered after
`ack_wait_s`. An engine failure hands the part back (nak) for another worker until the last delivery, which
answers the error so the gateway can name the part that failed everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.msg import Msg

from coderai.contracts import PartDone, WorkPart, decode, model_key, why_malformed
from coderai.contracts.ops import ENGINE_OPS
from coderai.contracts.subjects import EVT_PART_DONE, WORK_PART
from coderai.contracts.topology import HDR_REQUEST_ID, WORK
from coderai.contracts.work import ACK_WAIT_S, MAX_DELIVER, work_consumer
from coderai.runtime.bus import FrameWriter

if TYPE_CHECKING:
    from coderai.engine_worker.host import EngineHost

__all__ = ["PartPuller", "consumer_name"]

log = logging.getLogger("coderai.engine_worker")

PROGRESS_S = 1.0  # while a part runs, JetStream is told this often that its worker is still on it
FETCH_S = 1.0  # a pull request lives this long: one lost with a head's death is made again within it
MIN_BACKOFF_S, MAX_BACKOFF_S = 0.5, 4.0  # a puller whose engine failed a part waits this long before the next


consumer_name = work_consumer


class PartPuller:
    """Pulls one (model, op)'s parts, one at a time, and runs them on the host's engine."""

    def __init__(
        self, host: EngineHost, op: str, ack_wait_s: float = ACK_WAIT_S, max_deliver: int = MAX_DELIVER
    ) -> None:
        self.host = host
        self.op = op
        self.ack_wait_s = ack_wait_s
        self.max_deliver = max_deliver
        self._sub: Any = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._backoff_s = MIN_BACKOFF_S

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _subscribe(self) -> None:
        """Bind the shared durable consumer, retried until it exists: the scheduler makes it (`consumer_config`)
        before it lets this node pull, and a node may not make or change it. (A worker with a service's rights, in
        tests, makes it itself, with the same settings.)"""
        from nats.js.api import AckPolicy, ConsumerConfig

        subject = WORK_PART(model_key=model_key(self.host.config.name), op=self.op)
        cfg = ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            filter_subject=subject,
        )
        while True:
            try:
                self._sub = await self.host.bus.js.pull_subscribe(
                    subject, durable=consumer_name(self.host.config.name, self.op), stream=WORK.name, config=cfg
                )
                return
            except Exception as exc:  # the head creates WORK; until then, wait for it
                if self._stopping:  # a cancel inside a nats-py request can come out as its own error
                    raise asyncio.CancelledError from None
                log.info("no work queue for %s/%s yet (%s); retrying", self.host.config.name, self.op, exc)
                await asyncio.sleep(1.0)

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()  # the durable consumer stays: other holders still pull from it

    async def _loop(self) -> None:
        import nats.errors

        await self._subscribe()
        while True:
            try:
                msgs = await self._sub.fetch(1, timeout=FETCH_S)
            except (asyncio.TimeoutError, nats.errors.TimeoutError):
                # Python 3.11's wait_for can swallow a cancel that meets the fetch's own timeout (gh-86296): a
                # stop asked for then would wait for this loop forever (an admin's drain timed out so in CI)
                if self._stopping:
                    raise asyncio.CancelledError from None
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # reconnecting; the next fetch retries
                if self._stopping:
                    raise asyncio.CancelledError from None
                log.warning("fetching parts for %s/%s failed: %s", self.host.config.name, self.op, exc)
                await asyncio.sleep(1.0)
                continue
            for msg in msgs:
                if await self._one(msg) == "retry":
                    # this engine just failed a part and handed it back: step aside for a moment, so the
                    # redelivery goes to another holder instead of coming straight back here (three quick
                    # failures here would use up the part's deliveries while a healthy worker waits)
                    await asyncio.sleep(self._backoff_s)
                    self._backoff_s = min(self._backoff_s * 2, MAX_BACKOFF_S)
                else:
                    self._backoff_s = MIN_BACKOFF_S

    async def _one(self, msg: Msg) -> str:
        host = self.host
        try:
            part = decode(msg.data, WorkPart)
            job = ENGINE_OPS[self.op].decode(bytes(part.job))
        except (msgspec.ValidationError, msgspec.DecodeError, KeyError) as exc:
            log.error("dropping a malformed part: %s", why_malformed(exc))
            await msg.term()
            return "dropped"
        deliveries = msg.metadata.num_delivered if msg.metadata else 1
        last = deliveries >= self.max_deliver
        t0 = time.monotonic()
        writer = FrameWriter(host.bus.nc, part.reply)
        with contextlib.suppress(Exception):  # the gateway learns at once that the part reached a worker
            await writer.keepalive(True)
        keep = asyncio.create_task(self._in_progress(msg))
        try:
            status = await host._run(self.op, job, writer, {HDR_REQUEST_ID: part.request_id}, give_back=not last)
        finally:
            keep.cancel()
        if status == "retry":
            await msg.nak()
        else:
            await msg.ack()
        if status == "failed" and last:
            log.error("part %d/%d of %s failed on its last delivery", part.part + 1, part.parts, part.request_id)
        evt = PartDone(
            request_id=part.request_id,
            model=part.model,
            op=part.op,
            part=part.part,
            node_id=host.node_id,
            engine_id=host.engine_id,
            status=status,
            deliveries=deliveries,
            duration_s=time.monotonic() - t0,
            ts=time.time(),
        )
        with contextlib.suppress(Exception):
            await host.bus.publish(EVT_PART_DONE, evt, node_id=host.node_id)
        return status

    async def _in_progress(self, msg: Msg) -> None:
        """Keep the part ours while it runs (a long image or transcription outlasts `ack_wait_s`)."""
        while True:
            await asyncio.sleep(min(PROGRESS_S, self.ack_wait_s / 3))
            with contextlib.suppress(Exception):
                await msg.in_progress()
