"""`Bus.serve_stream` against a real nats-server: a job answered with a stream of frames, and each way it can fail
answered as one typed ErrorReply frame on the job's reply subject."""

from __future__ import annotations

import asyncio
import logging


from coderai.contracts import BusError, ChatJob, Chunk, ErrorReply, Final, Frame, KeepAlive, decode
from coderai.contracts.subjects import Subject
from coderai.runtime.bus import Bus, FrameWriter


def _subject(unique: str) -> Subject:
    # a per-test subject; its `model` token names the sender, so a job naming another model is refused
    return Subject(f"test.{unique}.{{model}}.job", ChatJob, Frame, bind=("model",))


def _job(rid: str = "r", model: str = "m") -> ChatJob:
    return ChatJob(request_id=rid, model=model, messages=[], stream=True)


async def _frames(stream) -> list:
    """Every frame of a stream up to and including its last (Final or ErrorReply)."""
    out = []
    while True:
        f = decode(await stream.next_raw(), Frame)
        out.append(f)
        if isinstance(f, (Final, ErrorReply)):
            stream.close()
            return out


async def _ask(bus: Bus, subj: Subject, job: ChatJob, model: str = "m") -> list:
    return await _frames(await bus.open_stream(subj, job, idle_timeout_s=10, model=model))


def _recording(ran: list[str], answer: bool = True):
    """A handler that notes each job it runs (and answers it with a Final unless `answer` is false)."""

    async def handler(job: ChatJob, w: FrameWriter, _m) -> None:
        ran.append(job.request_id)
        if answer:
            await w.send(Final(seq=w.next_seq(), engine_id="e"))

    return handler


class Tasks:
    """A `spawn` that keeps its tasks, as the engine host does."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()

    def __call__(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


async def test_a_job_streams_its_frames_in_order(bus, unique):
    subj = _subject(unique)

    async def handler(job: ChatJob, w: FrameWriter, m) -> None:
        assert m.subject == subj(model="m")
        await w.keepalive()
        for i in range(3):
            await w.send(Chunk(seq=w.next_seq(), delta={"content": f"{job.request_id}-{i}"}))
        await w.send(Final(seq=w.next_seq(), engine_id="e"))

    await bus.serve_stream(subj, handler)
    frames = await _ask(bus, subj, _job("r1"))
    assert [type(f) for f in frames] == [KeepAlive, Chunk, Chunk, Chunk, Final]
    assert [f.seq for f in frames] == [1, 2, 3, 4, 5]
    assert [f.delta["content"] for f in frames if isinstance(f, Chunk)] == ["r1-0", "r1-1", "r1-2"]


async def test_spawned_jobs_run_side_by_side(bus, unique):
    """With `spawn` a job that waits for a later one does not hold it up (awaited inline, this would hang)."""
    subj = _subject(unique)
    second_started = asyncio.Event()
    spawn = Tasks()

    async def handler(job: ChatJob, w: FrameWriter, _m) -> None:
        if job.request_id == "first":
            await asyncio.wait_for(second_started.wait(), 10)
        else:
            second_started.set()
        await w.send(Final(seq=w.next_seq(), engine_id=job.request_id))

    await bus.serve_stream(subj, handler, spawn=spawn)
    first, second = await asyncio.gather(_ask(bus, subj, _job("first")), _ask(bus, subj, _job("second")))
    assert (first[-1].engine_id, second[-1].engine_id) == ("first", "second")


async def test_a_malformed_job_is_a_bad_request(bus, unique):
    subj = _subject(unique)
    ran: list[str] = []

    handler = _recording(ran, answer=False)
    await bus.serve_stream(subj, handler, spawn=Tasks())
    for payload in (b"not json", b'{"request_id": "r"}'):  # not JSON; JSON but not a chat job
        stream, reply = await bus.expect_stream(10)
        await bus.nc.publish(subj(model="m"), payload, reply=reply)
        frames = await _frames(stream)
        assert len(frames) == 1 and frames[0].code == "bad_request" and frames[0].seq == 1
    assert ran == []


async def test_a_job_for_another_sender_is_forbidden(bus, unique):
    subj = _subject(unique)
    ran: list[str] = []
    await bus.serve_stream(subj, _recording(ran))
    frames = await _ask(bus, subj, _job("r", model="m"), model="other")  # the subject says `other`, the job `m`
    assert len(frames) == 1 and frames[0].code == "forbidden" and frames[0].seq == 1
    assert ran == []
    assert isinstance((await _ask(bus, subj, _job("ok", model="m")))[-1], Final)
    assert ran == ["ok"]


async def test_a_bus_error_raised_is_its_own_reply(bus, unique):
    subj = _subject(unique)

    async def handler(job: ChatJob, w: FrameWriter, _m) -> None:
        await w.send(Chunk(seq=w.next_seq(), delta={"content": "partial"}))
        raise BusError("no_engine", "the devices went away", retryable=True, param="model")

    await bus.serve_stream(subj, handler, spawn=Tasks())
    chunk, err = await _ask(bus, subj, _job())
    assert isinstance(chunk, Chunk) and chunk.seq == 1
    assert (err.code, err.message, err.retryable, err.param, err.seq) == (
        "no_engine",
        "the devices went away",
        True,
        "model",
        2,
    )


async def test_a_crash_is_logged_and_answered_internal(bus, unique, caplog):
    subj = _subject(unique)

    async def handler(job: ChatJob, w: FrameWriter, _m) -> None:
        raise RuntimeError("boom")

    await bus.serve_stream(subj, handler, spawn=Tasks())
    with caplog.at_level(logging.ERROR, logger="coderai.bus"):
        frames = await _ask(bus, subj, _job())
    assert len(frames) == 1
    err = frames[0]
    assert (err.code, err.retryable, err.seq) == ("internal", False, 1) and "RuntimeError: boom" in err.message
    assert any("failed" in r.getMessage() and r.exc_info for r in caplog.records)


async def test_a_spawn_that_refuses_answers_its_error_and_never_runs_the_job(bus, unique):
    subj = _subject(unique)
    ran: list[str] = []

    def refuse(coro) -> None:
        raise BusError("busy", "full", retryable=True)

    handler = _recording(ran, answer=False)
    await bus.serve_stream(subj, handler, spawn=refuse)
    frames = await _ask(bus, subj, _job())
    assert len(frames) == 1 and (frames[0].code, frames[0].retryable, frames[0].seq) == ("busy", True, 1)
    assert ran == []


async def test_a_job_without_a_reply_subject_is_dropped(bus, unique):
    subj = _subject(unique)
    ran: list[str] = []
    await bus.serve_stream(
        subj, _recording(ran)
    )  # inline: jobs in arrival order, so the second's answer follows the first
    await bus.publish(subj, _job("no-reply"), model="m")
    assert isinstance((await _ask(bus, subj, _job("answered")))[-1], Final)
    assert ran == ["answered"]
