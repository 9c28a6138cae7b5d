"""The order in which an engine's queued jobs get its slots: interactive turns first, then background work (a UI's
title and tag tasks, anything sent with `X-Coderai-Priority: background`), each in arrival order.

An engine's thread pool has one thread per slot and would take jobs first come, first served; this gate stands in
front of it and hands out the slots. A job holds its slot from `acquire` until `release`."""

from __future__ import annotations

import asyncio
import heapq
import itertools


class PriorityGate:
    def __init__(self, slots: int) -> None:
        self.free = max(1, slots)
        self._waiting: list[tuple[int, int, asyncio.Future]] = []  # (priority, arrival, its wake-up)
        self._arrival = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for *_, f in self._waiting if not f.done())

    async def acquire(self, priority: int = 0) -> None:
        if self.free > 0 and not self.waiting:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._arrival), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed the slot as it was cancelled: pass it on
                self.release()
            raise

    def release(self) -> None:
        while self._waiting:
            *_, fut = heapq.heappop(self._waiting)
            if not fut.done():
                fut.set_result(None)  # the slot goes straight to the next job
                return
        self.free += 1
