"""An engine host's jobs on a real nats-server (the echo engine, so no model): streamed frames, the typed
errors `Bus.serve_stream` answers for it (a malformed job, a full queue), a relayed video's stage jobs, and a
fan-out part pulled from the work queue."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from coderai.contracts import CancelJob, ChatJob, Chunk, ErrorReply, Final, Frame, ModelConfig, SamplingParams, decode
from coderai.contracts.media import VideoJob
from coderai.contracts.stages import SchedulerState, Stage, StageDone, StageFrame, StageJob
from coderai.contracts.subjects import ENGINE_CANCEL, ENGINE_CHAT, ENGINE_STAGE
from coderai.engine_worker import stage_host
from coderai.engine_worker.host import EngineHost
from coderai.runtime.blobs import BlobService, BlobStore
from coderai.runtime.bus import Bus
from coderai.runtime.lifecycle import wait_for


@pytest.fixture
async def host(bus, unique):
    h = EngineHost(bus, f"n{unique}", ModelConfig(name="echo", engine="echo", path="-"), keepalive_s=5)
    assert await h.load()
    yield h
    await h.unload(5)


async def _frames(stream, frame_type=Frame) -> list:
    out = []
    while True:
        f = decode(await stream.next_raw(), frame_type)
        out.append(f)
        if isinstance(f, (Final, StageDone, ErrorReply)):
            stream.close()
            return out


async def _chat(bus: Bus, host: EngineHost, rid: str, stream: bool = True) -> list:
    job = ChatJob(
        request_id=rid,
        model="echo",
        messages=[{"role": "user", "content": "hi"}],
        stream=stream,
        params=SamplingParams(max_tokens=3),
    )
    return await _frames(
        await bus.open_stream(ENGINE_CHAT, job, idle_timeout_s=10, node_id=host.node_id, engine_id=host.engine_id)
    )


async def test_a_chat_job_streams_chunks_then_its_final(bus, host):
    frames = await _chat(bus, host, "r1")
    assert [f.seq for f in frames] == list(range(1, len(frames) + 1))
    assert all(isinstance(f, Chunk) for f in frames[:-1])
    assert "".join(f.delta.get("content", "") for f in frames[:-1] if f.delta) == "This is the"
    final = frames[-1]
    assert isinstance(final, Final) and final.engine_id == host.engine_id and final.usage.completion_tokens == 3
    await wait_for(lambda: host.in_flight == 0 and not host._tasks, 10, what="the job to finish")
    assert host.served == 1


async def test_a_cancel_heard_before_its_job_still_cancels_it(bus, host):
    """The job and its cancel come on different subscriptions: a client that leaves at once may be heard first."""
    await bus.publish(ENGINE_CANCEL, CancelJob(request_id="early"), node_id=host.node_id, engine_id=host.engine_id)
    await wait_for(lambda: "early" in host._early_cancels, 10, what="the worker to hear the cancel")
    frames = await _chat(bus, host, "early", stream=False)
    assert isinstance(frames[-1], Final) and frames[-1].usage.completion_tokens == 0  # it never ran
    assert "early" not in host._early_cancels
    frames = await _chat(bus, host, "later", stream=False)  # the next job is not touched
    assert frames[-1].usage.completion_tokens == 3


async def test_a_malformed_job_is_a_bad_request(bus, host):
    stream, reply = await bus.expect_stream(10)
    await bus.nc.publish(ENGINE_CHAT(node_id=host.node_id, engine_id=host.engine_id), b'{"model": "echo"}', reply=reply)
    frames = await _frames(stream)
    assert len(frames) == 1 and frames[0].code == "bad_request" and frames[0].seq == 1
    assert host.served == 0


async def test_beyond_the_queue_limit_a_job_is_told_busy(bus, host):
    host.engine.queue_limit = 1
    release = asyncio.Event()
    host.spawn(release.wait())  # something holds the one place in the queue
    frames = await _chat(bus, host, "r-busy")
    assert len(frames) == 1 and (frames[0].code, frames[0].retryable, frames[0].seq) == ("busy", True, 1)
    release.set()
    await wait_for(lambda: not host._tasks, 10, what="the queue to empty")
    assert isinstance((await _chat(bus, host, "r-after"))[-1], Final)


def _stage_job(host: EngineHost, kind: str, rid: str) -> StageJob:
    return StageJob(
        request_id=rid,
        job=VideoJob(request_id=rid, model="echo", prompt="a cat"),
        steps=2,
        stage=Stage(index=0, kind=kind, start=0, end=2, node=host.node_id, engine_id=host.engine_id),
    )


async def _stage(bus: Bus, host: EngineHost, job: StageJob) -> list:
    return await _frames(
        await bus.open_stream(ENGINE_STAGE, job, idle_timeout_s=10, node_id=host.node_id, engine_id=host.engine_id),
        StageFrame,
    )


async def test_stage_jobs_are_served_and_their_failures_answered(bus, host):
    from coderai.engine_worker.engines.video_stages import StageOutput

    def stage(job, inputs, flag, on_step):  # the engine's thread: one step, then the video
        on_step(0)
        return StageOutput(
            tensors={},
            scheduler=SchedulerState(name="ddim", steps=2, timesteps=[1.0, 0.0]),
            seed=0,
            guidance=1.0,
            frames=b"mp4 bytes",
            tokens=4,
        )

    host.engine.stage = stage
    blobs = await BlobService(BlobStore(bus, create=True)).start(bus)  # the gateway's blob service
    sub = await stage_host.subscribe(host)
    try:
        stream, reply = await bus.expect_stream(10)
        await bus.nc.publish(ENGINE_STAGE(node_id=host.node_id, engine_id=host.engine_id), b"[]", reply=reply)
        bad = await _frames(stream, StageFrame)
        assert len(bad) == 1 and bad[0].code == "bad_request" and bad[0].seq == 1

        progress, done = await _stage(bus, host, _stage_job(host, "encode", "v1"))
        assert isinstance(progress, Chunk) and progress.progress == 0.5
        assert isinstance(done, StageDone) and done.video is not None and done.usage.total_tokens == 4
        assert (progress.seq, done.seq) == (1, 2)

        refused = await _stage(bus, host, _stage_job(host, "denoise", "v2"))  # a denoise stage needs a handoff
        assert len(refused) == 1 and refused[0].code == "bad_request" and "handoff" in refused[0].message

        def broken(*_args):
            raise RuntimeError("out of memory")

        host.engine.stage = broken
        failed = await _stage(bus, host, _stage_job(host, "encode", "v3"))
        assert len(failed) == 1 and (failed[0].code, failed[0].retryable) == ("engine_failed", True)
        assert "out of memory" in failed[0].message
    finally:
        await sub.unsubscribe()
        for s in blobs:
            await s.unsubscribe()


async def test_a_fanout_part_pulled_from_the_work_queue_answers_its_reply_subject(bus, unique):
    """A part runs through the same job path as a direct job, its frames to the reply subject the part names."""
    from coderai.contracts import WorkPart, encode, model_key
    from coderai.contracts.subjects import WORK_PART
    from coderai.contracts.topology import WORK
    from coderai.engine_worker.parts import PartPuller

    name = f"echo{unique}"
    h = EngineHost(bus, f"n{unique}", ModelConfig(name=name, engine="echo", path="-"), keepalive_s=5)
    assert await h.load()
    await bus.ensure_stream(WORK)
    puller = PartPuller(h, "chat", ack_wait_s=5)
    puller.start()
    try:
        stream, reply = await bus.expect_stream(10)
        job = ChatJob(
            request_id="p1",
            model=name,
            messages=[{"role": "user", "content": "hi"}],
            params=SamplingParams(max_tokens=2),
        )
        part = WorkPart(
            request_id="p1", model=name, op="chat", part=0, parts=1, reply=reply, job=msgspec.Raw(encode(job))
        )
        await bus.js.publish(WORK_PART(model_key=model_key(name), op="chat"), encode(part))
        frames = await _frames(stream)
        assert isinstance(frames[-1], Final) and frames[-1].engine_id == h.engine_id
        assert frames[-1].choices[0].message["content"] == "This is"
        await wait_for(lambda: h.served == 1 and h.in_flight == 0, 10, what="the part to finish")
    finally:
        await puller.stop()
        await h.unload(5)
