"""NATS helpers: typed request/reply, typed handlers, and streamed replies over a connection `nats_conn` makes.

Streamed replies: the caller publishes a job with a reply subject under one inbox prefix that its `Bus`
subscribes to once (`<inbox>.*`), so starting a stream costs one publish and no extra SUB. The callee
publishes numbered frames there (`Bus.serve_stream` hands its handler a `FrameWriter` on it); the caller's
`FrameStream` yields them in order and tells the callee to stop (`cancel`) when the caller goes away.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import ConnectionClosedError
from nats.errors import Error as NatsError
from nats.js.kv import KeyValue

from coderai.contracts import BusError, ErrorReply, KeepAlive, decode, encode, why_malformed
from coderai.contracts.subjects import Subject
from coderai.contracts.topology import HDR_REQUEST_ID, BucketSpec, StreamSpec
from coderai.runtime import ids
from coderai.runtime.nats_conn import close_nats, connect, split_urls, url_user

if TYPE_CHECKING:
    from coderai.runtime.settings import CommonSettings

log = logging.getLogger("coderai.bus")

T = TypeVar("T")
Rep = TypeVar("Rep")
AnySubject = Subject[object, object]
"""Every subject (a Subject's types are read only)."""

# a handler takes the request its subject carries, whichever that is: Any, as object would refuse a handler of one
Handler = Callable[[Any, Msg], Awaitable[object]]
"""handler(request, msg) of `Bus.serve`: its return value (if any) is the reply."""
StreamHandler = Callable[[Any, "FrameWriter", Msg], Awaitable[None]]
"""handler(job, writer, msg) of `Bus.serve_stream`: runs the job, its frames written with `writer`."""
Spawn = Callable[[Coroutine[Any, Any, None]], object]
"""spawn(coro) of `Bus.serve_stream`: starts one job's coroutine, or raises BusError to refuse the job."""

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
HANDOUT_PREFIX = "coderai.reply"
"""Where replies go whose subject rides inside a message (runtime/members.py lets nodes publish, not subscribe)."""

_NO_RESPONDERS: Any = object()  # queued instead of frame bytes when the server reports no responders
_REFUSED: Any = object()  # queued when the server refused to carry the request (this connection's permissions)


def _refused(subject: str) -> BusError:
    return BusError(
        "internal",
        f"NATS refused to carry a request to {subject}: this connection's credentials "
        "(its cluster role) may not publish there",
        retryable=False,
    )


class _Tick:
    """A timeout marker put into a queue by a timer; only the one for the current wait counts."""

    __slots__ = ()


TIMED_OUT: Any = object()


LATE_S = 0.25
"""A timer that fires this much after its deadline says the process itself was not running (starved of CPU, its
pages read back from disk): the wait is given once more as long as it was late, at most `LATE_GRACE_S`."""
LATE_GRACE_S = 1.0


async def get_or_timeout(queue: asyncio.Queue, timeout_s: float) -> Any:
    """`queue.get()`, or TIMED_OUT after `timeout_s` without an item.

    On the hot path: asyncio.wait_for costs a task per call; a timer handle that drops a marker into the queue
    costs far less. A marker whose wait already ended (the item won the race) is skipped later.

    A process that did not run for a while finds its timer due and the answer that arrived meanwhile still in its
    socket, a few loop turns from the queue; the timer runs first. So a marker that comes late (`LATE_S`) is a
    stall of this process, not silence of the peer: the wait goes on once, as long as it was late (at most
    `LATE_GRACE_S`), and the answer wins if it was there.
    """
    if not queue.empty():
        item = queue.get_nowait()
        if not isinstance(item, _Tick):
            return item
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    tick = _Tick()
    handle = loop.call_later(timeout_s, queue.put_nowait, tick)
    extended = False
    try:
        while True:
            item = await queue.get()
            if item is tick:
                late = loop.time() - deadline
                if extended or late < LATE_S:
                    return TIMED_OUT
                tick, extended = _Tick(), True
                handle = loop.call_later(min(late, LATE_GRACE_S), queue.put_nowait, tick)
                continue
            if not isinstance(item, _Tick):
                return item
    finally:
        handle.cancel()


DONE: Any = object()
"""Put on a job's queue once the job's thread has returned (or raised)."""


async def pump(
    queue: asyncio.Queue,
    writer: "FrameWriter",
    keepalive_s: float,
    send: Callable[[Any], Awaitable[object]],
    queued: Callable[[], bool] | None = None,
) -> None:
    """Hand what a job's thread puts on `queue` to `await send(item)` until `DONE`, with a keep-alive frame on
    `writer` whenever nothing came for `keepalive_s`: the caller tells a slow job from a dead worker by it, and
    a queued one (`queued()` true: it waits for a slot) from a running one."""
    while True:
        item = await get_or_timeout(queue, keepalive_s)
        if item is TIMED_OUT:
            await writer.keepalive(queued is not None and queued())
        elif item is DONE:
            return
        else:
            await send(item)


class Silence(BusError):
    """Nothing arrived on a stream for its idle timeout (as opposed to a lost connection or no responder)."""


class FrameStream:
    """The frames of one streamed reply, in order. Iterate it; `cancel()` if you stop early."""

    def __init__(self, bus: "Bus", token: str, idle_timeout_s: float, subject: str = "") -> None:
        self._bus = bus
        self.token = token
        self.subject = subject  # where the request went: a refused publish there ends this stream at once
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.idle_timeout_s = idle_timeout_s
        # until the first frame (a callee answers at once, or keeps alive each second): silence this long means the
        # job never reached it (lost with a NATS server that died under it), found sooner than a dead callee is
        self.first_timeout_s = idle_timeout_s
        self.on_cancel: Callable[[], Awaitable[None]] | None = None
        self.done = False

    async def next_raw(self) -> bytes:
        """The next frame's bytes; BusError on an idle gap longer than the timeout or a lost connection."""
        data = await get_or_timeout(self.queue, self.first_timeout_s)
        if data is TIMED_OUT:
            if self.first_timeout_s < self.idle_timeout_s:
                raise Silence(
                    "engine_failed",
                    f"the engine sent nothing within {self.first_timeout_s:g}s of the job "
                    "(lost on its way, or the engine is stalled)",
                    retryable=True,
                )
            raise Silence("engine_failed", f"engine went silent for {self.idle_timeout_s:.0f}s", retryable=True)
        self.first_timeout_s = self.idle_timeout_s
        if data is None:  # this process' own connection dropped, not the engine: "try again" (a 503), as request()
            raise BusError("no_engine", "lost the connection to the message bus", retryable=True)
        if data is _NO_RESPONDERS:
            raise BusError("no_engine", "the engine is not listening", retryable=True)
        if data is _REFUSED:
            raise _refused(self.subject)
        return data

    async def next(self, type_: type[T] | object) -> T:
        """The next frame, decoded as `type_`. One that does not decode ends the stream as an `engine_failed`
        BusError, logged in one line: a broken or hostile engine fails its own request, never its caller."""
        data = await self.next_raw()
        try:
            return decode(data, type_)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            why = why_malformed(exc)
            log.warning("malformed frame from %s: %s", self.subject or "a part's engine", why)
            raise BusError("engine_failed", f"the engine answered with a malformed frame ({why})") from None

    async def cancel(self) -> None:
        """Tell the callee to stop, once."""
        if not self.done and self.on_cancel is not None:
            self.done = True
            try:
                await self.on_cancel()
            except Exception as exc:  # best effort: the callee also stops on its own deadline
                log.debug("cancel failed: %s", exc)
        self.close()

    def close(self) -> None:
        self.done = True
        self._bus._streams.pop(self.token, None)


class Bus:
    """A NATS connection plus the typed operations coderai services use on it."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self._inbox = nc.new_inbox()
        # replies whose subject is handed out inside a message (fan-out parts) come here: a node may publish under
        # this prefix but subscribe nowhere in it, and every token is random, so it can answer only what it was given
        self._handout = f"{HANDOUT_PREFIX}.{self._inbox.rsplit('.', 1)[-1]}"
        self._streams: dict[str, FrameStream] = {}
        self._mux_sub: Any = None
        self._handout_sub: Any = None
        self.replicas = 1  # streams and buckets made (or found with fewer) get this many (CODERAI_NATS_REPLICAS)
        self.fitted: set[str] = set()  # streams whose replica count this connection has checked
        self.role = ""  # the head service this connection logs in as (members.SERVICE_ROLES); '': any other login

    @classmethod
    async def connect(cls, url: str, name: str, **kw: Any) -> "Bus":
        """Connect to `url` as the user it names. A head service's user (`svc-<role>`) gets its role's own inbox
        prefix, the only inbox its rights let it subscribe to (members.service_inbox)."""
        from coderai.runtime.members import service_inbox, service_role

        role = service_role(url_user(url))
        if role and not kw.get("inbox_prefix"):
            kw["inbox_prefix"] = service_inbox(role)
        made: list[Bus] = []  # the error callback is wired before the Bus exists

        def on_refused(subject: str) -> None:
            if made:
                made[0].refuse(subject)

        bus = cls(await connect(url, name, on_refused=on_refused, **kw))
        bus.role = role
        made.append(bus)
        return bus

    def refuse(self, subject: str) -> None:
        """NATS refused a publish to `subject`: end every request waiting for an answer from there, instead of
        letting it wait out its timeout for a reply that cannot come."""
        subject = subject.lower()  # nats-py hands the server's error text over lowercased
        for s in list(self._streams.values()):
            if s.subject.lower() == subject:
                s.queue.put_nowait(_REFUSED)

    @classmethod
    async def connect_as(cls, settings: CommonSettings, name: str, url: str = "", **kw: Any) -> "Bus":
        """Connect a service with the credentials in its settings' NATS URL (or the password file it names: a
        service's own file, `nats-svc-<role>.password`, logs in as `svc-<role>`; any other as `service`)."""
        url = url or settings.nats_url or DEFAULT_NATS_URL
        password_file = getattr(settings, "nats_password_file", "")
        if password_file:
            from coderai.runtime.cluster import with_user
            from coderai.runtime.members import SERVICE_USER, file_user, read_secret

            path = Path(os.path.expanduser(password_file))
            password = read_secret(path)
            user = file_user(path.name) or SERVICE_USER
            url = ",".join(with_user(u, user, password) for u in split_urls(url))
        ca = getattr(settings, "nats_ca", "")
        if ca and "tls" not in kw:
            from coderai.runtime.tls import ca_text, client_context

            kw["tls"] = client_context(ca_text(ca))
        bus = await cls.connect(url, name, **kw)
        bus.replicas = max(1, int(getattr(settings, "nats_replicas", 1) or 1))
        return bus

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    async def close(self) -> None:
        for s in list(self._streams.values()):
            s.queue.put_nowait(None)
        if not self.nc.is_closed:
            try:
                await close_nats(self.nc, drain=True)
            except Exception:  # a connection already down cannot drain
                await close_nats(self.nc)

    def fail_streams(self) -> None:
        """Wake every open stream with an error (used when the connection drops)."""
        for s in list(self._streams.values()):
            s.queue.put_nowait(None)

    # --- request / reply -------------------------------------------------------------------------

    async def request(
        self,
        subject: Subject[object, Rep],
        msg: object,
        *,
        timeout: float = 5.0,
        headers: dict[str, str] | None = None,
        **params: str,
    ) -> Rep:
        """Send `msg` on `subject(**params)` and return the typed reply; an ErrorReply is raised as BusError.

        The reply comes through the same inbox subscription as streamed frames: no SUB, no task, no
        per-request future bookkeeping (nats-py's own request() costs a wait_for task per call).
        """
        if not self.nc.is_connected:
            raise BusError("no_engine", "message bus unavailable", retryable=True)
        await self._ensure_mux()
        token = ids.token_hex(8)  # unguessable: a reply subject names one request, never its neighbours
        where = subject(**params)
        pending = FrameStream(self, token, timeout, where)
        self._streams[token] = pending
        try:
            try:
                await self.nc.publish(where, subject.encode(msg), reply=f"{self._inbox}.{token}", headers=headers)
            except ConnectionClosedError:
                raise BusError("no_engine", "message bus unavailable", retryable=True) from None
            data = await get_or_timeout(pending.queue, timeout)
        finally:
            pending.close()
        if data is TIMED_OUT:
            raise BusError("timeout", f"no reply on {subject.pattern} within {timeout}s", retryable=True)
        if data is None:
            raise BusError("no_engine", "lost the connection to the message bus", retryable=True)
        if data is _NO_RESPONDERS:
            raise BusError("no_engine", f"nobody serves {subject.pattern}", retryable=True)
        if data is _REFUSED:
            raise _refused(where)
        try:
            out = subject.decode_reply(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            why = why_malformed(exc)
            log.warning("malformed reply on %s: %s", where, why)
            raise BusError("internal", f"the reply on {subject.pattern} is malformed ({why})") from None
        if isinstance(out, ErrorReply):
            raise BusError.from_reply(out)
        return out

    async def publish(
        self, subject: AnySubject, msg: object, *, headers: dict[str, str] | None = None, **params: str
    ) -> None:
        await self.nc.publish(subject(**params), subject.encode(msg), headers=headers)

    async def serve(
        self,
        subject: AnySubject,
        handler: Handler,
        *,
        queue: str = "",
        subject_str: str | None = None,
    ) -> Subscription:
        """Subscribe `handler(request, msg)`; its return value (if any) is the reply, exceptions become ErrorReply."""

        async def _cb(m: Msg) -> None:
            try:
                req = subject.decode(m.data)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                if m.reply:  # the caller hears why; nothing is logged (a flood of bad requests floods no log)
                    await m.respond(encode(ErrorReply(code="bad_request", message=why_malformed(exc))))
                else:
                    log.warning("dropping a malformed message on %s: %s", m.subject, why_malformed(exc))
                return
            if not subject.bound_to(m.subject, req):
                log.warning("dropping a message on %s that speaks for another sender", m.subject)
                if m.reply:
                    await m.respond(
                        encode(
                            ErrorReply(code="forbidden", message="the message names another sender than its subject")
                        )
                    )
                return
            try:
                out = await handler(req, m)
            except BusError as exc:
                out = exc.to_reply()
            except Exception as exc:  # outermost edge of a handler: log, answer typed
                rid = (m.headers or {}).get(HDR_REQUEST_ID, "")
                log.exception("handler for %s failed", m.subject, extra={"request_id": rid})
                out = ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}")
            if out is not None and m.reply:
                await m.respond(encode(out))

        return await self.nc.subscribe(subject_str or subject.wildcard(), queue=queue, cb=_cb)

    async def serve_stream(
        self,
        subject: AnySubject,
        handler: StreamHandler,
        *,
        queue: str = "",
        subject_str: str | None = None,
        spawn: Spawn | None = None,
    ) -> Subscription:
        """Subscribe `handler(job, writer, msg)` for jobs answered with a stream of frames on the job's reply subject.

        The handler runs the job and writes its frames (keep-alives included) with `writer`, a `FrameWriter` on
        `msg.reply`. What goes wrong outside it, or escapes it, ends the stream with one ErrorReply frame: a job that
        does not decode is `bad_request`, one on a subject bound to another sender `forbidden`, a BusError raised
        is its own reply, any other exception is logged and answered `internal`. A message without a reply subject
        is dropped: there is nowhere to stream to.

        `spawn(coro)`: how each job runs. None: awaited in the subscription's callback, so one job at a time, in
        arrival order. Otherwise it is called there with the job's coroutine and starts it (as a task it keeps, so
        jobs run side by side and a shutdown can wait for them); a BusError it raises refuses the job (`busy`),
        answered as above.
        """

        async def _run(job: object, writer: FrameWriter, m: Msg) -> None:
            try:
                await handler(job, writer, m)
            except BusError as exc:
                await writer.answer(exc.to_reply(writer.next_seq()))
            except Exception as exc:  # outermost edge of a job: log, answer typed
                rid = (m.headers or {}).get(HDR_REQUEST_ID, "")
                log.exception("stream handler for %s failed", m.subject, extra={"request_id": rid})
                await writer.answer(
                    ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}", seq=writer.next_seq())
                )

        nc = self.nc

        async def _cb(m: Msg) -> None:
            if not m.reply:
                return
            writer = FrameWriter(nc, m.reply)
            try:
                job = subject.decode(m.data)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                await writer.answer(ErrorReply(code="bad_request", message=why_malformed(exc), seq=writer.next_seq()))
                return
            if not subject.bound_to(m.subject, job):
                log.warning("dropping a message on %s that speaks for another sender", m.subject)
                await writer.answer(
                    ErrorReply(
                        code="forbidden",
                        seq=writer.next_seq(),
                        message="the message names another sender than its subject",
                    )
                )
                return
            if spawn is None:
                await _run(job, writer, m)
                return
            coro = _run(job, writer, m)
            try:
                spawn(coro)
            except BusError as exc:  # refused (busy): never started
                coro.close()
                await writer.answer(exc.to_reply(writer.next_seq()))
            except Exception:
                coro.close()
                raise

        return await self.nc.subscribe(subject_str or subject.wildcard(), queue=queue, cb=_cb)

    async def listen(
        self,
        subject: AnySubject,
        handler: Callable[[Any, Msg], Awaitable[None]],
        *,
        subject_str: str | None = None,
    ) -> Subscription:
        """Subscribe `handler(message, msg)` to a publish-only subject; a malformed message is logged and dropped,
        so one bad publisher cannot stop a service."""

        async def _cb(m: Msg) -> None:
            try:
                obj = subject.decode(m.data)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                log.warning("dropping a malformed message on %s: %s", m.subject, why_malformed(exc))
                return
            if not subject.bound_to(m.subject, obj):
                log.warning("dropping a message on %s that speaks for another sender", m.subject)
                return
            await handler(obj, m)

        return await self.nc.subscribe(subject_str or subject.wildcard(), cb=_cb)

    # --- streamed replies ------------------------------------------------------------------------

    async def _ensure_mux(self) -> None:
        if self._mux_sub is None:

            async def _dispatch(m: Msg) -> None:
                s = self._streams.get(m.subject.rsplit(".", 1)[-1])
                if s is not None:
                    if not m.data and m.headers and m.headers.get("Status") == "503":
                        s.queue.put_nowait(_NO_RESPONDERS)  # the server's word that nobody subscribes there
                    else:
                        s.queue.put_nowait(m.data)

            self._dispatch = _dispatch
            self._mux_sub = await self.nc.subscribe(self._inbox + ".*", cb=_dispatch)

    async def open_stream(
        self,
        subject: AnySubject,
        msg: object,
        *,
        idle_timeout_s: float,
        first_timeout_s: float = 0.0,
        headers: dict[str, str] | None = None,
        on_cancel: Callable[[], Awaitable[None]] | None = None,
        encoded: bytes | None = None,
        **params: str,
    ) -> FrameStream:
        """Publish a job whose reply is a stream of frames; returns the stream to read them from. `encoded`:
        `subject.encode(msg)` made already (a caller that measured it, or sends it again to another engine).
        `first_timeout_s`: a shorter wait for the first frame (a callee that keeps alive answers within it)."""
        stream, reply = await self.expect_stream(idle_timeout_s)
        if 0 < first_timeout_s < idle_timeout_s:
            stream.first_timeout_s = first_timeout_s
        stream.on_cancel = on_cancel
        stream.subject = subject(**params)
        try:
            data = subject.encode(msg) if encoded is None else encoded
            await self.nc.publish(stream.subject, data, reply=reply, headers=headers)
        except Exception:
            stream.close()
            raise
        return stream

    async def expect_stream(self, idle_timeout_s: float) -> tuple[FrameStream, str]:
        """A stream for frames that will arrive at the returned inbox subject (which the caller hands out, e.g.
        inside a fan-out part); nothing is published."""
        if not self.nc.is_connected:
            raise BusError("no_engine", "message bus unavailable", retryable=True)
        await self._ensure_mux()
        if self._handout_sub is None:  # only callers that hand replies out subscribe here (gateways)
            self._handout_sub = await self.nc.subscribe(self._handout + ".*", cb=self._dispatch)
        token = ids.token_hex(8)
        stream = FrameStream(self, token, idle_timeout_s)
        self._streams[token] = stream
        return stream, f"{self._handout}.{token}"

    # --- JetStream topology ----------------------------------------------------------------------

    async def kv(self, spec: BucketSpec) -> KeyValue:
        """Bind a KV bucket, creating it when missing; see `stores.key_value`."""
        from coderai.runtime.stores import key_value

        return await key_value(self, spec)

    async def object_store(self, spec: BucketSpec, *, create: bool = False, max_bytes: int = 0) -> Any:
        """Bind the object store `spec` names (`BLOBS`, `FILES`); see `stores.object_store`."""
        from coderai.runtime.stores import object_store

        return await object_store(self, spec, create=create, max_bytes=max_bytes)

    async def ensure_stream(self, spec: StreamSpec) -> None:
        """Create a stream if missing; see `stores.ensure_stream`."""
        from coderai.runtime.stores import ensure_stream

        await ensure_stream(self, spec)


class FrameWriter:
    """The callee's side of a streamed reply: numbers frames and sends keep-alives while quiet."""

    def __init__(self, nc: NATS, reply: str) -> None:
        self.nc = nc
        self.reply = reply
        self.seq = 0
        self.last_sent = time.monotonic()

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    async def send(self, frame: object) -> None:
        self.last_sent = time.monotonic()
        await self.nc.publish(self.reply, encode(frame))

    async def keepalive(self, queued: bool = False) -> None:
        await self.send(KeepAlive(seq=self.next_seq(), queued=queued))

    async def answer(self, err: ErrorReply) -> None:
        """Send the frame that ends the stream with an error; a connection that is gone is only logged (the caller
        then ends on its idle timeout)."""
        try:
            await self.send(err)
        except NatsError as exc:
            log.debug("cannot answer %s on %s: %s", err.code, self.reply, exc)
