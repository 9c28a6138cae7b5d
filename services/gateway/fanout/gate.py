"""Whether the `WORK` queue takes a (model, op)'s parts now.

When a nats-server dies, the RAFT groups it led (the `WORK` stream's, a shared consumer's) elect another leader
4 to 9 s later; until then a publish to the stream waits out its timeout and a look at the consumer gets no
answer. Fan-out is a speed-up, so such a request goes whole to one engine. Without this gate every request of
those seconds would first wait the publish timeout (2 s each, on every gateway); with it, the first failure
closes the gate for its consumer, the requests after it go whole at once, and one probe per closed consumer asks
the stream and the consumer until both answer, then opens it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from nats.errors import Error as NatsError

from coderai.contracts.topology import WORK

if TYPE_CHECKING:
    from coderai.runtime.bus import Bus

log = logging.getLogger("coderai.gateway")

PROBE_EVERY_S = 0.25
PROBE_TIMEOUT_S = 0.5  # a stream or consumer with a leader answers its info in milliseconds


class QueueGate:
    """The consumers of `WORK` that took no parts lately, each with the task probing it until it answers."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._closed: dict[str, asyncio.Task[None]] = {}

    def open(self, consumer: str) -> bool:
        """True unless a publish to `consumer`'s queue or a look at it failed and it has not answered since."""
        return consumer not in self._closed

    def failed(self, consumer: str, why: str) -> None:
        """A publish for `consumer` or a look at it failed: close its gate and probe it until it answers."""
        if consumer in self._closed:
            return
        log.info(
            "the work queue of %s takes no parts (%s): requests go whole to one engine until it does", consumer, why
        )
        self._closed[consumer] = asyncio.get_running_loop().create_task(self._probe(consumer))

    async def _probe(self, consumer: str) -> None:
        started = time.monotonic()
        try:
            while True:
                await asyncio.sleep(PROBE_EVERY_S)
                try:
                    async with asyncio.timeout(PROBE_TIMEOUT_S):
                        await self.bus.js.stream_info(WORK.name)
                        await self.bus.js.consumer_info(WORK.name, consumer)
                except (NatsError, TimeoutError):
                    continue  # no leader yet (or the consumer is not made yet): its parts still go whole
                log.info("the work queue of %s takes parts again after %.1f s", consumer, time.monotonic() - started)
                return
        finally:
            self._closed.pop(consumer, None)

    def stop(self) -> None:
        for task in self._closed.values():
            task.cancel()
        self._closed.clear()
