"""The bus helpers against a real nats-server: typed request/reply, streamed frames, KV revision checks."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from coderai.contracts import (
    BusError,
    CancelJob,
    ChatJob,
    Chunk,
    ErrorReply,
    Final,
    Frame,
    KeepAlive,
    RouteDecision,
    RouteRequest,
    decode,
    encode,
)
from coderai.contracts.subjects import ENGINE_CANCEL, ENGINE_CHAT, Subject
from coderai.contracts.topology import BucketSpec
from coderai.runtime.bus import LATE_S, Bus, FrameWriter
from coderai.runtime.kv import RevisionCache, put_if_changed
from coderai.testing.procs import wait_until


def _subject(unique: str) -> Subject:
    # a per-test subject with the route contract, so tests never see each other's traffic
    return Subject(f"test.{unique}.pick", RouteRequest, RouteDecision)


async def test_typed_request_reply(bus, unique):
    subj = _subject(unique)

    async def handler(req: RouteRequest, _m):
        return RouteDecision(engine_id=f"e-{req.model}", node_id="n", reason="least_busy")

    await bus.serve(subj, handler)
    out = await bus.request(subj, RouteRequest(request_id="r", model="m1", op="chat"))
    assert out == RouteDecision(engine_id="e-m1", node_id="n", reason="least_busy")


async def test_handler_errors_come_back_typed(bus, unique):
    subj = _subject(unique)

    async def handler(req: RouteRequest, _m):
        if req.model == "typed":
            raise BusError("no_engine", "nothing here", retryable=True)
        raise RuntimeError("boom")

    await bus.serve(subj, handler)
    with pytest.raises(BusError) as typed:
        await bus.request(subj, RouteRequest(request_id="r", model="typed", op="chat"))
    assert (typed.value.code, typed.value.retryable) == ("no_engine", True)
    with pytest.raises(BusError) as crashed:
        await bus.request(subj, RouteRequest(request_id="r", model="x", op="chat"))
    assert crashed.value.code == "internal" and "boom" in crashed.value.message


async def test_malformed_request_gets_bad_request(bus, unique):
    subj = _subject(unique)
    await bus.serve(subj, lambda req, m: None)
    reply = await bus.nc.request(subj(), b'{"not": "a route request"}', timeout=30)
    err = decode(reply.data, ErrorReply)
    assert err.code == "bad_request"


async def test_bad_bytes_deep_or_huge_get_a_short_bad_request(bus, unique):
    """JSON nested past the decoder's recursion limit is a decode error like any other (it used to escape the
    handler unanswered), and an error's text stays short however long the field it names."""
    subj = Subject(f"test.{unique}.chat", ChatJob, Frame)
    await bus.serve(subj, lambda req, m: None)
    for payload in (b'{"messages":[{"content":' + b"[" * 200_000, b'{"' + b"k" * 500_000 + b'":1}'):
        err = decode((await bus.nc.request(subj(), payload, timeout=30)).data, ErrorReply)
        assert err.code == "bad_request" and len(err.message) < 300, err.message[:300]


async def test_a_frame_that_does_not_decode_is_an_engine_failure(bus, unique):
    """A broken or hostile engine's bad bytes end its stream as a typed error (a 502 at the gateway)."""
    stream, reply = await bus.expect_stream(idle_timeout_s=2)
    await bus.nc.publish(reply, b'{"t": "final", "seq": "one"}')
    with pytest.raises(BusError) as exc:
        await stream.next(Frame)
    assert exc.value.code == "engine_failed" and "malformed" in exc.value.message


async def test_no_responders_is_a_retryable_no_engine(bus, unique):
    with pytest.raises(BusError) as exc:
        await bus.request(_subject(unique), RouteRequest(request_id="r", model="m", op="chat"), timeout=2)
    assert exc.value.code == "no_engine" and exc.value.retryable


async def _fake_engine(bus: Bus, engine_id: str, frames: int, cancelled: asyncio.Event, keepalives: int = 0):
    async def on_job(m):
        job = ENGINE_CHAT.decode(m.data)
        w = FrameWriter(bus.nc, m.reply)
        for _ in range(keepalives):
            await w.keepalive()
        for i in range(frames):
            await w.send(Chunk(seq=w.next_seq(), delta={"content": f"{job.request_id}-{i}"}))
        await w.send(Final(seq=w.next_seq(), engine_id=engine_id))

    async def on_cancel(m):
        cancelled.set()

    await bus.nc.subscribe(ENGINE_CHAT(node_id="n", engine_id=engine_id), cb=on_job)
    await bus.nc.subscribe(ENGINE_CANCEL(node_id="n", engine_id=engine_id), cb=on_cancel)


async def test_stream_delivers_frames_in_order(bus, unique):
    await _fake_engine(bus, unique, frames=50, cancelled=asyncio.Event(), keepalives=2)
    job = ChatJob(request_id="r1", model="m", messages=[], stream=True)
    stream = await bus.open_stream(ENGINE_CHAT, job, idle_timeout_s=30, node_id="n", engine_id=unique)
    frames = []
    while True:
        f = decode(await stream.next_raw(), Frame)
        frames.append(f)
        if isinstance(f, Final):
            break
    stream.close()
    assert [f.seq for f in frames] == list(range(1, 54))
    assert sum(isinstance(f, KeepAlive) for f in frames) == 2
    assert [f.delta["content"] for f in frames if isinstance(f, Chunk)] == [f"r1-{i}" for i in range(50)]


async def test_concurrent_streams_do_not_mix(bus, unique):
    await _fake_engine(bus, unique, frames=20, cancelled=asyncio.Event())

    async def one(rid: str) -> list[str]:
        job = ChatJob(request_id=rid, model="m", messages=[], stream=True)
        s = await bus.open_stream(ENGINE_CHAT, job, idle_timeout_s=30, node_id="n", engine_id=unique)
        out = []
        while not isinstance(f := decode(await s.next_raw(), Frame), Final):
            out.append(f.delta["content"])
        s.close()
        return out

    results = await asyncio.gather(*(one(f"r{i}") for i in range(16)))
    for i, r in enumerate(results):
        assert r == [f"r{i}-{k}" for k in range(20)]


async def test_cancel_reaches_the_callee(bus, unique):
    cancelled = asyncio.Event()
    await _fake_engine(bus, unique, frames=1, cancelled=cancelled)

    async def send_cancel():
        await bus.publish(ENGINE_CANCEL, CancelJob(request_id="r"), node_id="n", engine_id=unique)

    s = await bus.open_stream(
        ENGINE_CHAT,
        ChatJob(request_id="r", model="m", messages=[]),
        idle_timeout_s=30,
        on_cancel=send_cancel,
        node_id="n",
        engine_id=unique,
    )
    await s.next_raw()
    await s.cancel()
    await asyncio.wait_for(cancelled.wait(), 5)
    assert s.token not in bus._streams


async def test_an_answer_that_came_while_the_asker_was_stalled_is_not_a_timeout(bus, nats_server, unique):
    """The asker's process does not run past its timeout (starved, its pages read back from disk) while the answer
    arrives: the answer waits in its socket behind the due timer, and is taken, not a `timeout`. A real silence
    is still one, the same length as before."""
    subj = _subject(unique)
    asked, stalled, answered = threading.Event(), threading.Event(), threading.Event()

    def responder(ready: threading.Event, stop: threading.Event) -> None:
        async def main() -> None:
            other = await Bus.connect(nats_server.url, "test")

            async def answer(m) -> None:  # only once the asker's loop has stopped running
                asked.set()
                await asyncio.to_thread(stalled.wait, 10)
                await m.respond(encode(RouteDecision(engine_id="e", node_id="n", reason="least_busy")))
                await other.nc.flush()  # on its way to the asker's socket
                answered.set()

            await other.nc.subscribe(subj.pattern, cb=answer)
            await other.nc.flush()
            ready.set()
            await asyncio.to_thread(stop.wait)
            await other.close()

        asyncio.run(main())

    ready, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=responder, args=(ready, stop))
    t.start()
    try:
        assert await asyncio.to_thread(ready.wait, 10)
        ask = asyncio.create_task(bus.request(subj, RouteRequest(request_id="r", model="m", op="chat"), timeout=0.3))
        assert await asyncio.to_thread(asked.wait, 10)  # meanwhile the ask runs and is sent
        # this loop stops running (the poll blocks it) until the answer has been sent to its socket and the ask's
        # timer is overdue by more than LATE_S
        due = time.monotonic() + 0.3 + LATE_S + 0.1
        stalled.set()
        wait_until(lambda: answered.is_set() and time.monotonic() > due, 10, "the answer sent, the timer overdue")
        assert (await asyncio.wait_for(ask, 10)).engine_id == "e"

        async def listen_only(_m) -> None:  # there, and silent
            return None

        sub = await bus.nc.subscribe(_subject(unique + "-silent").pattern, cb=listen_only)
        start = time.monotonic()
        with pytest.raises(BusError) as exc:
            await bus.request(
                _subject(unique + "-silent"), RouteRequest(request_id="r", model="m", op="chat"), timeout=0.3
            )
        assert exc.value.code == "timeout"
        assert time.monotonic() - start < 0.3 + LATE_S  # a timer on time gets no grace
        await sub.unsubscribe()
    finally:
        stop.set()
        await asyncio.to_thread(t.join, 10)


async def test_silent_engine_times_out(bus, unique):
    async def listen_only(_m):  # the engine is there but never answers
        return None

    await bus.nc.subscribe(ENGINE_CHAT(node_id="n", engine_id=unique), cb=listen_only)
    s = await bus.open_stream(
        ENGINE_CHAT, ChatJob(request_id="r", model="m", messages=[]), idle_timeout_s=0.3, node_id="n", engine_id=unique
    )
    with pytest.raises(BusError) as exc:
        await s.next_raw()
    assert exc.value.code == "engine_failed" and exc.value.retryable


async def test_a_job_nobody_acknowledges_fails_on_the_short_first_wait(bus, unique):
    """A job lost on its way (a NATS server died under it) is found by `first_timeout_s`, not the idle timeout."""

    async def listen_only(_m):
        return None

    await bus.nc.subscribe(ENGINE_CHAT(node_id="n", engine_id=unique), cb=listen_only)
    s = await bus.open_stream(
        ENGINE_CHAT,
        ChatJob(request_id="r", model="m", messages=[]),
        idle_timeout_s=60,
        first_timeout_s=0.3,
        node_id="n",
        engine_id=unique,
    )
    with pytest.raises(BusError) as exc:
        await asyncio.wait_for(s.next_raw(), 10)  # far sooner than the minute of the idle timeout
    assert exc.value.code == "engine_failed" and exc.value.retryable and "sent nothing within 0.3s" in exc.value.message


async def test_after_its_first_frame_a_stream_waits_the_idle_timeout(bus, unique):
    async def one_keepalive(m):
        await FrameWriter(bus.nc, m.reply).keepalive(True)

    await bus.nc.subscribe(ENGINE_CHAT(node_id="n", engine_id=unique), cb=one_keepalive)
    s = await bus.open_stream(
        ENGINE_CHAT,
        ChatJob(request_id="r", model="m", messages=[]),
        idle_timeout_s=1.5,
        first_timeout_s=0.2,
        node_id="n",
        engine_id=unique,
    )
    assert isinstance(decode(await s.next_raw(), Frame), KeepAlive)
    assert s.first_timeout_s == 1.5  # the short wait was for the first frame only
    with pytest.raises(BusError) as exc:
        await s.next_raw()
    assert "went silent" in exc.value.message


async def test_stream_to_nobody_fails_fast_as_no_engine(bus, unique):
    s = await bus.open_stream(
        ENGINE_CHAT, ChatJob(request_id="r", model="m", messages=[]), idle_timeout_s=30, node_id="n", engine_id=unique
    )
    with pytest.raises(BusError) as exc:
        await asyncio.wait_for(s.next_raw(), 5)
    assert exc.value.code == "no_engine"


async def test_kv_bucket_and_revision_checked_writes(bus, unique):
    kv = await bus.kv(BucketSpec(f"test_{unique}", ttl_s=60))
    assert await put_if_changed(kv, "k", b"v1") is True
    assert await put_if_changed(kv, "k", b"v1") is False  # unchanged: no write, no new revision
    rev = (await kv.get("k")).revision
    await kv.put("k", b"other-writer")  # someone else moved the revision on
    assert await put_if_changed(kv, "k", b"v2") is True
    entry = await kv.get("k")
    assert entry.value == b"v2" and entry.revision > rev
    status = await kv.status()
    assert status.ttl == 60  # the bucket's TTL, in seconds


async def test_revision_cache_recovers_from_a_foreign_write(bus, unique):
    kv = await bus.kv(BucketSpec(f"test_{unique}"))
    cache = RevisionCache(kv)
    await cache.put("n1", b"a")
    await cache.put("n1", b"b")
    await kv.put("n1", b"foreign")
    await cache.put("n1", b"c")
    assert (await kv.get("n1")).value == b"c"


async def test_listen_decodes_and_drops_malformed_messages(bus, unique):

    got: list[str] = []
    done = asyncio.Event()

    async def handler(job: CancelJob, _m) -> None:
        got.append(job.request_id)
        if job.request_id == "last":
            done.set()

    await bus.listen(ENGINE_CANCEL, handler, subject_str=ENGINE_CANCEL(node_id="n", engine_id=unique))
    for payload in (b'{"request_id": "a"}', b"not json", b'{"surprise": 1}', b'{"request_id": "last"}'):
        await bus.nc.publish(ENGINE_CANCEL(node_id="n", engine_id=unique), payload)
    await asyncio.wait_for(done.wait(), 5)
    assert got == ["a", "last"]  # the two malformed ones were dropped, and the listener kept going


async def test_closing_while_nats_py_reconnects_is_quiet(nats_server):
    """nats-py's reconnect task awaits the dropped socket's close waiter; close() cancels that task, which cancels
    the waiter close() then awaits: nc.close() raised CancelledError (a revoked node's test, in CI). close_nats
    closes it quietly. The drop is nats-py's own read-error path, taken the way a server's hang-up takes it."""
    from coderai.runtime.nats_conn import close_nats

    b = await Bus.connect(nats_server.url, "test-close-race")
    transport, closing = b.nc._transport, asyncio.Event()
    shut = transport.close

    def close_and_say() -> None:  # the reconnect task's first step: told before its socket's close is scheduled
        closing.set()
        shut()

    transport.close = close_and_say
    await b.nc._process_op_err(ConnectionResetError("the server hung up"))  # schedules nats-py's reconnect task
    await closing.wait()  # woken ahead of the socket's close, while that task awaits its close waiter
    await close_nats(b.nc)
    assert b.nc.is_closed


async def test_a_cancelled_close_still_cancels():
    """Only nats-py's own cancellation is swallowed: a task cancelled while it closes ends cancelled."""
    from coderai.runtime.nats_conn import close_nats

    started = asyncio.Event()

    class _SlowClose:
        async def close(self) -> None:
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(close_nats(_SlowClose()))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
