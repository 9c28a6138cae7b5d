"""The gate in front of an engine's threads (engine_worker/gate.py): queued interactive jobs get a free slot before
queued background ones, each kind in arrival order, and a job that gives up while queued holds no slot."""

from __future__ import annotations

import asyncio

from coderai.engine_worker.gate import PriorityGate
from coderai.runtime.lifecycle import wait_for


def test_interactive_jobs_are_served_before_background_ones_each_in_arrival_order():
    async def scenario() -> list[str]:
        gate, order = PriorityGate(1), []
        await gate.acquire()  # a job holds the one slot

        async def job(name: str, priority: int) -> None:
            await gate.acquire(priority)
            order.append(name)
            gate.release()

        tasks = [asyncio.create_task(job(n, p)) for n, p in (("title", 1), ("turn-1", 0), ("tags", 1), ("turn-2", 0))]
        await wait_for(lambda: gate.waiting == 4, 5, interval_s=0.001, what="each job queued, in the order made")
        gate.release()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["turn-1", "turn-2", "title", "tags"]


def test_a_job_that_leaves_the_queue_takes_no_slot():
    async def scenario() -> tuple[int, bool]:
        gate = PriorityGate(2)
        await gate.acquire()
        await gate.acquire()
        leaver = asyncio.create_task(gate.acquire(0))
        stayer = asyncio.create_task(gate.acquire(1))
        await wait_for(lambda: gate.waiting == 2, 5, interval_s=0.001, what="both jobs queued")
        leaver.cancel()
        gate.release()  # the slot skips the job that left
        await stayer
        gate.release()
        gate.release()
        return gate.free, leaver.cancelled()

    assert asyncio.run(scenario()) == (2, True)
