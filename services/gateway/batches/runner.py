"""The batches one gateway runs, and its sweeper: the replica that takes over batches whose gateway stopped.

A batch runs its lines in input order, each one a `Call` run as one part on the `WORK` queue (`queue.py`), so a
line is admitted and accounted for its key exactly like a request (usage, budget, `request.completed`). Each
answer is stored once (`records.py`), then the record's `request_counts` follow. At the end (every line answered,
a cancel, or the completion window passed) the output and error files are written (`output.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from coderai.contracts.topology import BATCH_LINES, BATCHES, BucketSpec
from coderai.gateway import takeover
from coderai.gateway.auth import Caller
from coderai.gateway.batches import line as line_run
from coderai.gateway.batches import output, queue, validation
from coderai.gateway.batches.records import (
    RUNNING,
    BatchRecord,
    BatchTenure,
    LineError,
    claim,
    due,
    Tally,
    each_line,
    store_line,
)
from coderai.gateway.errors import ApiError
from coderai.gateway.pipeline import HEADROOM
from coderai.gateway.state import Gateway
from coderai.gateway.takeover import Superseded, Takeovers, caller_for

if TYPE_CHECKING:
    from coderai.gateway.openai.files import Records

log = logging.getLogger("coderai.gateway")

CANCEL_WATCH_S = 0.5  # how often a batch with lines in flight looks for a cancel


class BatchRunner(Takeovers[BatchRecord]):
    """The batches this gateway runs, and its sweeper (`coderai.gateway.takeover`): a batch whose gateway stopped
    is taken over by another replica, or by this gateway restarted."""

    bucket, record, what = BATCHES, BatchRecord, "batch"

    def __init__(self, gw: Gateway, records: Records) -> None:
        super().__init__(gw, max(1.0, gw.settings.video_takeover_s))  # the background jobs' takeover threshold
        self.records = records  # the files' (openai/files.py), for the input and output files
        self.lanes = queue.Lanes()
        self._kv: dict[str, KeyValue] = {}

    def live(self, rec: BatchRecord) -> bool:
        return rec.status in RUNNING

    def due(self, rec: BatchRecord, quiet_s: float) -> bool:
        return due(rec, quiet_s, self.after_s)

    def claim(self, rec: BatchRecord) -> BatchRecord:
        return claim(rec, self.me, time.time())

    async def resume(self, kv: KeyValue, was: BatchRecord, taken: BatchRecord, revision: int) -> None:
        if taken.status != "failed":
            log.warning(
                "batch %s: its gateway %s stopped; taken over (takeover %d, %d of %d lines answered)",
                taken.id,
                was.runner or "?",
                taken.takeovers,
                was.completed + was.failed,
                was.total,
            )
            self.spawn(BatchTenure(kv, taken, revision), None, None)

    async def kv(self, spec: BucketSpec = BATCHES) -> KeyValue:
        if spec.name not in self._kv:
            self._kv[spec.name] = await self.gw.bus.kv(spec)
        return self._kv[spec.name]

    async def parse(self, data: bytes, endpoint: str) -> tuple[list[validation.Line], list[LineError]]:
        """The batch's lines, each checked as its request would be: against a whole catalogue (a line naming a model
        a catalogue being rebuilt lacks is not refused for it), off the event loop."""
        if not await self.gw.catalog.wait_complete(self.gw.settings.failover_wait_s):
            raise self.gw.not_ready()
        return await asyncio.to_thread(validation.parse, data, endpoint, self.gw.model)

    async def start(self, rec: BatchRecord, lines: list[validation.Line], who: Caller) -> BatchRecord:
        """Keep a new batch's record and run it here."""
        rec = msgspec.structs.replace(rec, runner=self.me)
        revision = await (await self.kv()).create(rec.id, msgspec.json.encode(rec))
        if rec.status == "in_progress":
            self.spawn(BatchTenure(await self.kv(), rec, revision), lines, who)
        return rec

    async def cancel(self, rec: BatchRecord) -> BatchRecord:
        """Mark a running batch cancelling (its runner, here or on another replica, sees it and stops)."""
        kv = await self.kv()
        for _ in range(10):
            entry = await kv.get(rec.id)
            assert entry.value is not None  # `get` of a live key has its value
            rec = msgspec.json.decode(entry.value, type=BatchRecord)
            if rec.status not in ("validating", "in_progress"):
                return rec
            now = time.time()
            new = msgspec.structs.replace(rec, status="cancelling", cancelling_at=int(now), updated_at=now)
            try:
                await kv.update(rec.id, msgspec.json.encode(new), last=entry.revision)
                return new
            except KeyWrongLastSequenceError:
                continue  # its runner wrote a count: read it again
        raise ApiError(503, "The batch is busy; try the cancel again.", type="service_unavailable", code="busy")

    def spawn(self, tenure: BatchTenure, lines: list[validation.Line] | None, who: Caller | None) -> None:
        self.track(tenure.rec.id, asyncio.create_task(self.work(tenure, lines, who)))

    async def keepalive(self, tenure: BatchTenure, work: asyncio.Task) -> None:
        """Touch the record while the batch runs (`takeover.keepalive`), and notice a cancel: one another gateway
        wrote shows in the mirror first."""

        async def cancelled() -> bool:
            await self.cancel_seen(tenure)
            return False

        await takeover.keepalive(tenure, work, self.touch_every_s, self.what, cancelled)

    async def cancel_seen(self, tenure: BatchTenure) -> bool:
        """Whether the batch is cancelling: its own record says so, or, read again, after the mirror showed a
        cancel that another gateway wrote."""
        seen = self.mirror.values.get(tenure.rec.id) if self.mirror else None
        if seen is not None and seen.status == "cancelling" and not tenure.cancelling:
            await tenure.refresh()
        return tenure.cancelling

    async def until_cancelled(self, tenure: BatchTenure) -> None:
        """Return once the batch is cancelling (looked at every `CANCEL_WATCH_S`)."""
        while not await self.cancel_seen(tenure):
            await asyncio.sleep(CANCEL_WATCH_S)

    async def work(self, tenure: BatchTenure, lines: list[validation.Line] | None, who: Caller | None) -> None:
        me = asyncio.current_task()
        assert me is not None  # `spawn` runs the batch as its own task
        keep = asyncio.create_task(self.keepalive(tenure, me))
        try:
            if lines is None or who is None:  # taken over: the lines and the caller again, from the record
                lines, who = await self.reload(tenure)
                if lines is None or who is None:
                    return
            tally = Tally()
            await each_line(await self.kv(BATCH_LINES), tenure.rec.id, tally.add)
            await self.count(tenure, tally)
            if tenure.rec.status in ("in_progress", "cancelling"):
                await self.run_lines(tenure, [ln for ln in lines if ln.index not in tally.done], who, tally)
            await self.finalize(tenure, lines)
        except Superseded as exc:
            log.warning("batch %s: %s; stopping here", tenure.rec.id, exc)
        except Exception:  # the outermost edge of a background job: logged; the sweeper takes it over later
            log.exception("batch %s stopped", tenure.rec.id)
        finally:
            keep.cancel()

    async def reload(self, tenure: BatchTenure) -> tuple[list[validation.Line] | None, Caller | None]:
        rec = tenure.rec
        if not await self.gw.catalog.wait_complete(self.gw.settings.failover_wait_s):
            raise self.gw.not_ready()  # not the batch's fault: the sweeper takes it over later
        try:
            who = await caller_for(self.gw.auth, rec.key_name)
            data = (await (await self.records.files()).get(rec.input_file_id)).data or b""
            lines, errors = await self.parse(data, rec.endpoint)
        except Exception as exc:  # the input file was deleted, or the key store is down
            errors, lines, who = (
                [
                    LineError(
                        code="input_unavailable",
                        message=f"The batch could not be resumed: its input file could not be read ({exc}).",
                    )
                ],
                [],
                None,
            )
        if errors:
            await tenure.save(status="failed", failed_at=int(time.time()), errors=[*rec.errors, *errors[:100]])
            return None, None
        return lines, who

    def stopping(self, tenure: BatchTenure) -> bool:
        return tenure.cancelling or time.time() >= tenure.rec.expires_at

    async def revoked(self, tenure: BatchTenure, who: Caller) -> bool:
        """Whether the batch's key was revoked (or deleted) since it started: its batch is then cancelled, as its
        owner would, and runs no further line. Asked of the key store before each line (one Redis read, against a
        whole model request)."""
        if not await self.gw.auth.revoked(who):
            return False
        log.info("batch %s: key %s was revoked; cancelling it", tenure.rec.id, who.key_name)
        if not tenure.cancelling:
            now_s = time.time()
            await tenure.save(status="cancelling", cancelling_at=int(now_s))
        return True

    async def run_lines(self, tenure: BatchTenure, todo: list[validation.Line], who: Caller, tally: Tally) -> None:
        """Every line not answered yet, in order, a bounded number on the queue at a time."""
        tasks: set[asyncio.Task] = set()
        try:
            for line in todo:
                lane = self.lanes(line.job.model, line.op)
                await lane.slots.acquire()
                if self.stopping(tenure):
                    lane.slots.release()
                    break
                if await self.revoked(tenure, who):  # its lines in flight are stopped too: billed to nobody
                    lane.slots.release()
                    for task in tasks:
                        task.cancel()
                    break
                task = asyncio.create_task(self.one(tenure, line, who, lane, tally))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await self.last_lines(tenure, tasks)
        finally:
            for task in tasks:
                task.cancel()

    async def last_lines(self, tenure: BatchTenure, tasks: set[asyncio.Task]) -> None:
        """Wait for the lines in flight (their first failure raised), unless the batch is cancelled meanwhile:
        then they stop too (their engines with them), and the batch ends now with what was answered, not when the
        slowest line ends (a line waiting for a model that never comes held a cancel for 90 s)."""
        lines = asyncio.gather(*tasks)
        watch = asyncio.create_task(self.until_cancelled(tenure))
        try:
            await asyncio.wait({lines, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if lines.done():
            lines.result()
            return
        log.info("batch %s cancelled: stopping its %d lines in flight", tenure.rec.id, len(tasks))
        lines.cancel()
        try:
            await lines
        except asyncio.CancelledError:  # the lines' own; the batch's task itself being cancelled goes on up
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise

    async def one(
        self, tenure: BatchTenure, line: validation.Line, who: Caller, lane: queue.Lane, tally: Tally
    ) -> None:
        try:
            res = await line_run.answer(self.gw, line, who, lane)
        finally:
            lane.slots.release()
        res = line_run.within(res, self.gw.bus.nc.max_payload - HEADROOM)
        if await store_line(await self.kv(BATCH_LINES), tenure.rec.id, res):
            tally.add(res)
            await self.count(tenure, tally)

    async def count(self, tenure: BatchTenure, tally: Tally) -> None:
        counts = tally.counts()
        if any(getattr(tenure.rec, k) != v for k, v in counts.items()):
            await tenure.save(**counts)

    async def finalize(self, tenure: BatchTenure, lines: list[validation.Line]) -> None:
        """Write the files from every stored line (plus, past the window, the lines it left unanswered)."""
        now = time.time()
        if tenure.rec.status != "finalizing":
            end = "cancelled" if tenure.cancelling else "expired" if now >= tenure.rec.expires_at else "completed"
            await tenure.save(status="finalizing", finalizing_at=int(now), ending=end)
        end = tenure.rec.ending or "completed"
        spool = output.Spool()
        try:
            await each_line(await self.kv(BATCH_LINES), tenure.rec.id, spool.add)
            if end == "expired":
                for ln in lines:
                    if ln.index not in spool.at:
                        spool.add(line_run.expired(ln))
            out_id, err_id = await output.write(self.records, tenure.rec, spool)
            ok, total = spool.completed, len(spool.at)
        finally:
            spool.close()
        await tenure.save(
            status=end,
            **{f"{end}_at": int(time.time())},
            output_file_id=out_id,
            error_file_id=err_id,
            completed=ok,
            failed=total - ok,
        )
