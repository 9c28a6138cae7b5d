"""Taking a video job over from a gateway that stopped: which records are due, the claim, the caller and job a
replica rebuilds from the record, and the revision-checked writes (against a real nats-server) that let exactly
one replica win and make a runner that was only slow stop."""

from __future__ import annotations


import msgspec
import pytest
from nats.js.errors import KeyWrongLastSequenceError

from coderai.contracts import VideoJob
from coderai.contracts.stages import Handoff, SchedulerState, StageRun
from coderai.contracts.topology import BucketSpec
from coderai.gateway.auth import Authenticator
from coderai.gateway.takeover import Superseded, caller_for
from coderai.gateway.video.records import (
    MAX_TAKEOVERS,
    VideoRecord,
    VideoTenure,
    claim,
    due,
)
from coderai.runtime.bus import Bus

JOB = VideoJob(request_id="abc", model="t2v", prompt="a cat", num_frames=4, width=64, height=64, fps=4, seed=7, steps=4)


def record(**kw) -> VideoRecord:
    base = dict(
        id="video_abc",
        model="t2v",
        prompt="a cat",
        status="in_progress",
        created_at=100,
        updated_at=100.0,
        size="64x64",
        seconds="1",
        key_name="alice",
        job=JOB,
        runner="gw-a",
    )
    return VideoRecord(**{**base, **kw})


def test_only_running_records_untouched_past_the_threshold_are_due():
    assert due(record(), quiet_s=21.0, after_s=20)
    assert due(record(status="queued"), quiet_s=21.0, after_s=20)
    assert not due(record(), quiet_s=19.0, after_s=20)  # its runner wrote recently
    assert not due(record(status="completed"), quiet_s=900.0, after_s=20)
    assert not due(record(status="failed"), quiet_s=900.0, after_s=20)
    assert not due(record(job=None), quiet_s=900.0, after_s=20)  # nothing to run it again from


def test_a_claim_names_the_new_runner_and_keeps_the_stages_done():
    done = [StageRun(kind="encode", node="n1"), StageRun(kind="denoise", start=0, end=2, node="n2")]
    taken = claim(record(stages=done), "gw-b", now=130.0)
    assert (taken.runner, taken.takeovers, taken.updated_at, taken.status) == ("gw-b", 1, 130.0, "in_progress")
    assert taken.stages == done and taken.job == JOB and taken.key_name == "alice"


def test_a_job_over_its_takeover_bound_is_failed_with_a_clear_error():
    lost = claim(record(takeovers=MAX_TAKEOVERS), "gw-b", now=130.0)
    assert lost.status == "failed" and lost.error_code == "runner_lost"
    assert f"taken over {MAX_TAKEOVERS} times" in lost.error


def test_the_record_carries_the_job_and_handoff_through_json():
    handoff = Handoff(
        job_id="abc",
        model="t2v",
        produced_by="denoise",
        node="n2",
        tensors={},
        seed=7,
        guidance=9.0,
        width=64,
        height=64,
        num_frames=4,
        fps=4,
        scheduler=SchedulerState(name="DDIMScheduler", steps=4, timesteps=[3, 2, 1, 0], step_index=2),
    )
    rec = record(handoff=handoff, takeovers=1)
    back = msgspec.json.decode(msgspec.json.encode(rec), type=VideoRecord)
    assert back == rec and back.job.seed == 7 and back.handoff.scheduler.step_index == 2


async def test_a_taken_over_job_runs_as_the_key_that_asked_for_it(redis_server, unique):
    import redis.asyncio as aioredis

    from coderai.accounts.keys import KeyStore

    auth = Authenticator(None)
    assert (await caller_for(auth, "alice")).key_name == "alice"  # keys file / no auth
    r = aioredis.from_url(redis_server.url)
    try:
        auth.store = KeyStore(r)
        await auth.store.create(f"k{unique}", ["inference"], rpm=5)
        who = await caller_for(auth, f"k{unique}")
        assert who.key is not None and who.key.name == f"k{unique}" and who.key.rpm == 5  # its limits still apply
    finally:
        await r.aclose()


@pytest.fixture
async def kv(nats_server, unique):
    bus = await Bus.connect(nats_server.url, "test")
    yield await bus.kv(BucketSpec(f"videos_{unique}", ttl_s=60))
    await bus.close()


async def test_one_replica_wins_the_claim_and_the_slow_runner_stops(kv):
    rec = record()
    first = await kv.create(rec.id, msgspec.json.encode(rec))
    runner = VideoTenure(kv, rec, first)
    # two replicas saw the same stale revision; the first claim wins, the second finds a newer revision
    won = await kv.update(rec.id, msgspec.json.encode(claim(rec, "gw-b", 200.0)), last=first)
    with pytest.raises(KeyWrongLastSequenceError):
        await kv.update(rec.id, msgspec.json.encode(claim(rec, "gw-c", 200.0)), last=first)
    # the old runner was only slow: its next write finds the job moved on and writes nothing
    with pytest.raises(Superseded):
        await runner.save(progress=50)
    now = msgspec.json.decode((await kv.get(rec.id)).value, type=VideoRecord)
    assert now.runner == "gw-b" and now.progress == 0 and (await kv.get(rec.id)).revision == won


async def test_a_runner_keeps_writing_its_own_record(kv):
    rec = record()
    runner = VideoTenure(kv, rec, await kv.create(rec.id, msgspec.json.encode(rec)))
    await runner.save(progress=10)
    await runner.save(stage="decode")
    now = msgspec.json.decode((await kv.get(rec.id)).value, type=VideoRecord)
    assert (now.progress, now.stage, now.runner) == (10, "decode", "gw-a") and now.updated_at > rec.updated_at
