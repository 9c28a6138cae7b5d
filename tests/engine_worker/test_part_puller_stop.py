"""A stop asked for while a part puller waits in its fetch ends the puller even when the cancel comes out as the
fetch's own timeout (Python 3.11's `asyncio.wait_for` can swallow a cancel that meets its timeout, gh-86296):
the loop went on fetching, the stop waited for it forever, and an admin's drain answered 504 in CI."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest

from coderai.engine_worker.parts import PartPuller


class _SwallowingFetch:
    """A pull subscription whose fetch turns the cancel it gets into its timeout, as the race does."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def fetch(self, batch: int, timeout: float):
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise nats.errors.TimeoutError from None


async def test_a_stop_ends_the_puller_when_the_cancel_comes_out_as_a_timeout():
    puller = object.__new__(PartPuller)
    sub = _SwallowingFetch()
    puller._stopping, puller._sub = False, sub

    async def bound() -> None:
        return None

    puller._subscribe = bound  # type: ignore[method-assign]
    task = asyncio.create_task(puller._loop())
    await asyncio.wait_for(sub.entered.wait(), 5)  # in its fetch now
    puller._stopping = True
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
