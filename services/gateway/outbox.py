"""`request.completed` events on their way to the EVENTS stream, which usage, spend and Prometheus are built from.

A core publish is lost when NATS is down or restarts with it in flight, so each event is published with a
JetStream ack and its request id as `Nats-Msg-Id`: an event not acked is kept here and sent again once NATS is
back, and one sent twice (its ack lost) is stored once, by the stream's duplicate window. The request itself never
waits: `put` only appends, and a task of its own publishes, up to `BATCH` events at once."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

from nats.js.errors import NoStreamResponseError

from coderai.contracts import RequestCompleted
from coderai.contracts.subjects import EVT_REQUEST_COMPLETED
from coderai.runtime.bus import Bus

log = logging.getLogger("coderai.gateway")

BATCH = 64
ACK_TIMEOUT_S = 2.0
RETRY_S = (0.25, 2.0)  # the wait after a failed round (NATS down, restarting, or its disk full), doubling up to


class Outbox:
    """At most `limit` events waiting (the oldest dropped beyond it, with one warning per thousand)."""

    def __init__(self, bus: Bus, limit: int = 100_000) -> None:
        self.bus = bus
        self.limit = limit
        self.queue: collections.deque[RequestCompleted] = collections.deque()
        self.dropped = 0
        self.no_stream = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # nothing waiting and nothing being sent
        self._idle.set()
        self._task: asyncio.Task | None = None

    def put(self, done: RequestCompleted) -> None:
        if len(self.queue) >= self.limit:
            self.queue.popleft()
            self.dropped += 1
            if self.dropped % 1000 == 1:
                log.warning("request.completed outbox full (%d waiting): %d events dropped so far", self.limit,
                            self.dropped)
        self.queue.append(done)
        self._idle.clear()
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="completed-outbox")

    async def close(self, deadline_s: float = 3.0) -> None:
        """Send what is waiting (for at most `deadline_s`), then stop."""
        if self._task is not None:  # without the sender (never started) nothing would drain the queue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), deadline_s)
        if self.queue:
            log.warning("%d request.completed events not sent at shutdown", len(self.queue))
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        wait = RETRY_S[0]
        while True:
            if not self.queue:
                self._wake.clear()
                self._idle.set()
                await self._wake.wait()
                continue
            batch = [self.queue.popleft() for _ in range(min(BATCH, len(self.queue)))]
            results = await asyncio.gather(*(self._send(e) for e in batch), return_exceptions=True)
            failed = [e for e, r in zip(batch, results) if isinstance(r, BaseException)]
            if not failed:
                wait = RETRY_S[0]
                continue
            self.queue.extendleft(reversed(failed))  # first in, first out, as they came
            log.debug("%d request.completed events not acked (%s); again in %.2fs", len(failed),
                      next(r for r in results if isinstance(r, BaseException)), wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, RETRY_S[1])

    async def _send(self, done: RequestCompleted) -> None:
        try:
            await self.bus.js.publish(EVT_REQUEST_COMPLETED(), EVT_REQUEST_COMPLETED.encode(done),
                                      timeout=ACK_TIMEOUT_S, headers={"Nats-Msg-Id": done.request_id})
        except NoStreamResponseError:
            # no EVENTS stream on this server (a bare nats-server, as some tests run): nothing stores events, and
            # the core subscribers (the router) already had this one, so sending it again would only repeat it
            if not self.no_stream:
                log.info("no EVENTS stream on this NATS: request.completed events are not stored")
            self.no_stream += 1
