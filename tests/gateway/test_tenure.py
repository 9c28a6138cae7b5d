"""A runner's hold on a background job's record (`coderai.gateway.takeover`: `Tenure`, `Superseded`, `keepalive`),
against a real nats-server: a write after another gateway claimed the record is refused, a write that lost its race
to a change the kind accepts goes on over it, and the keep-alive touches the record while the work runs and stops
the work once the record is another gateway's."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
from nats.js.errors import KeyWrongLastSequenceError

from coderai.contracts.base import Message
from coderai.contracts.topology import BucketSpec
from coderai.gateway import takeover
from coderai.gateway.batches.records import BatchRecord, BatchTenure
from coderai.gateway.takeover import RACES, Superseded, Tenure
from coderai.gateway.video.records import VideoRecord, VideoTenure
from coderai.runtime.lifecycle import wait_for


class Job(Message, frozen=True, kw_only=True):
    id: str
    runner: str
    updated_at: float
    progress: int = 0
    note: str = ""  # what another writer changes


class JobTenure(Tenure[Job]):
    record = Job  # the default hook: another writer's change is kept, the write goes on


@pytest.fixture
async def kv(bus, unique):
    return await bus.kv(BucketSpec(f"tenure_{unique}", ttl_s=60))


async def held(kv: Any, kind: type[Tenure], rec: Any) -> Tenure:
    return kind(kv, rec, await kv.create(rec.id, msgspec.json.encode(rec)))


async def stored(kv: Any, kind: type) -> tuple[Any, int]:
    entry = await kv.get("job")
    return msgspec.json.decode(entry.value, type=kind), entry.revision


async def write_over(kv: Any, kind: type, **changes: Any) -> int:
    """Another writer's change, made on the record as it is now (again, if the runner wrote meanwhile)."""
    while True:
        rec, revision = await stored(kv, kind)
        try:
            return await kv.update("job", msgspec.json.encode(msgspec.structs.replace(rec, **changes)), last=revision)
        except KeyWrongLastSequenceError:
            continue


async def test_a_write_after_another_gateway_claimed_the_record_is_superseded(kv):
    tenure = await held(kv, JobTenure, Job(id="job", runner="gw-a", updated_at=time.time()))
    claimed = await write_over(kv, Job, runner="gw-b")
    with pytest.raises(Superseded, match="now run by gw-b"):
        await tenure.save(progress=50)
    now, revision = await stored(kv, Job)
    assert (now.runner, now.progress, revision) == ("gw-b", 0, claimed)  # the slow runner wrote nothing


async def test_a_write_that_lost_its_race_to_an_accepted_change_goes_on_over_it(kv):
    tenure = await held(kv, JobTenure, Job(id="job", runner="gw-a", updated_at=time.time()))
    theirs = await write_over(kv, Job, note="theirs")
    await tenure.save(progress=50)
    now, revision = await stored(kv, Job)
    assert (now.runner, now.progress, now.note) == ("gw-a", 50, "theirs") and revision > theirs
    assert tenure.rec == now and tenure.revision == revision  # the next write names this revision
    await tenure.save(progress=60)
    assert (await stored(kv, Job))[0].progress == 60


async def test_a_runner_that_loses_every_race_gives_the_record_up(kv):
    tenure = await held(kv, JobTenure, Job(id="job", runner="gw-a", updated_at=time.time()))

    class Contested:  # another writer gets in before each of the runner's writes
        def __init__(self) -> None:
            self.races = 0

        async def update(self, key: str, value: bytes, last: int) -> int:
            self.races += 1
            await write_over(kv, Job, note=f"race {self.races}")
            return await kv.update(key, value, last=last)

        async def get(self, key: str) -> Any:
            return await kv.get(key)

    tenure.kv = contested = Contested()
    with pytest.raises(Superseded, match=f"lost {RACES} write races"):
        await tenure.save(progress=50)
    now, _ = await stored(kv, Job)
    assert contested.races == RACES and now.progress == 0 and now.note == f"race {RACES}"


async def test_a_batch_write_keeps_another_gateways_cancel(kv):
    rec = BatchRecord(
        id="job",
        key_name="alice",
        endpoint="/v1/chat/completions",
        input_file_id="file-1",
        status="validating",
        created_at=100,
        expires_at=100 + 86400,
        updated_at=100.0,
        total=3,
        runner="gw-a",
    )
    tenure = await held(kv, BatchTenure, rec)
    await write_over(kv, BatchRecord, status="cancelling", cancelling_at=200)  # a cancel through gateway B
    await tenure.save(status="in_progress", in_progress_at=150, completed=1)
    now, _ = await stored(kv, BatchRecord)
    assert (now.status, now.cancelling_at, now.in_progress_at, now.completed) == ("cancelling", 200, None, 1)
    assert tenure.cancelling and tenure.rec == now


async def test_a_batch_refresh_reads_a_cancel_and_a_claim(kv):
    rec = BatchRecord(
        id="job",
        key_name="alice",
        endpoint="/v1/chat/completions",
        input_file_id="file-1",
        status="in_progress",
        created_at=100,
        expires_at=100 + 86400,
        updated_at=100.0,
        runner="gw-a",
    )
    tenure = await held(kv, BatchTenure, rec)
    await write_over(kv, BatchRecord, status="cancelling", cancelling_at=200)
    await tenure.refresh()
    assert tenure.cancelling
    await write_over(kv, BatchRecord, runner="gw-b")
    with pytest.raises(Superseded):
        await tenure.refresh()


async def test_a_video_write_losing_to_its_job_ending_is_superseded(kv):
    rec = VideoRecord(
        id="job",
        model="t2v",
        prompt="a cat",
        status="in_progress",
        created_at=100,
        updated_at=100.0,
        size="64x64",
        seconds="1",
        runner="gw-a",
    )
    tenure = await held(kv, VideoTenure, rec)
    await write_over(kv, VideoRecord, progress=40)  # still its runner's and running: the write goes on
    await tenure.save(stage="decode")
    assert (await stored(kv, VideoRecord))[0].stage == "decode"
    ended = await write_over(kv, VideoRecord, status="failed", error_code="runner_lost")
    with pytest.raises(Superseded):
        await tenure.save(progress=90)
    now, revision = await stored(kv, VideoRecord)
    assert (now.status, now.progress, revision) == ("failed", 40, ended)


async def test_the_keepalive_touches_the_record_while_the_work_runs_and_stops_it_when_superseded(kv):
    tenure = await held(kv, JobTenure, Job(id="job", runner="gw-a", updated_at=time.time() - 60))
    first = tenure.revision
    work = asyncio.create_task(asyncio.Event().wait())  # a long job
    keep = asyncio.create_task(takeover.keepalive(tenure, work, 0.05, "job"))
    try:
        await wait_for(lambda: tenure.revision >= first + 2, 10, what="two touches")
        now, _ = await stored(kv, Job)
        assert now.runner == "gw-a" and now.updated_at > time.time() - 10 and not work.done()
        claimed = await write_over(kv, Job, runner="gw-b")  # taken for dead: another gateway claims it
        await wait_for(keep.done, 10, what="the keep-alive to stop")
        await wait_for(work.done, 10, what="the work to be cancelled")
        assert work.cancelled() and keep.exception() is None
        now, revision = await stored(kv, Job)
        assert now.runner == "gw-b" and revision == claimed  # the old runner wrote nothing after the claim
    finally:
        keep.cancel()
        work.cancel()


async def test_the_keepalive_stops_the_work_when_its_tick_says_so_and_rides_out_a_failing_one(kv):
    tenure = await held(kv, JobTenure, Job(id="job", runner="gw-a", updated_at=time.time()))
    ticks: list[str] = []
    answers = iter(["blink", "no", "stop"])

    async def tick() -> bool:
        answer = next(answers)
        ticks.append(answer)
        if answer == "blink":
            raise ConnectionError("the key store blinked")
        return answer == "stop"

    work = asyncio.create_task(asyncio.Event().wait())
    keep = asyncio.create_task(takeover.keepalive(tenure, work, 0.05, "job", tick))
    try:
        await wait_for(keep.done, 10, what="the keep-alive to stop")
        await wait_for(work.done, 10, what="the work to be cancelled")
        assert ticks == ["blink", "no", "stop"] and work.cancelled() and keep.exception() is None
        assert (await stored(kv, Job))[0].runner == "gw-a"  # stopped by its tick, the record stays its runner's
    finally:
        keep.cancel()
        work.cancel()
