"""Admission by expected wait: a job is taken while the jobs ahead of it per slot, times how long a job held a slot
lately, is under the model's `queue_time_s`; past it, `busy` carrying that wait (the client's Retry-After)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from coderai.contracts import BusError, ModelConfig
from coderai.engine_worker.host import DEFAULT_QUEUE_TIME_S, EngineHost


def _host(queue_time_s: float = 0.0, slots: int = 2, queue_limit: int = 0) -> EngineHost:
    h = EngineHost(
        None,
        "n",
        ModelConfig(name="m", engine="echo", path="-", queue_time_s=queue_time_s),
        keepalive_s=1.0,
    )
    h.engine = SimpleNamespace(max_concurrency=slots, queue_limit=queue_limit)
    return h


async def _idle() -> None:
    await asyncio.Event().wait()


def _running(h: EngineHost, n: int) -> None:
    for _ in range(n):
        h.spawn(_idle())


async def test_the_expected_wait_is_the_jobs_ahead_per_slot_times_the_recent_service_time():
    h = _host()
    assert h.expected_wait_s(0) == 0.0 and h.expected_wait_s(10) == 0.0  # nothing ran yet: nothing to go by
    h.service_s = 2.0
    assert h.expected_wait_s(1) == 0.0  # a free slot
    assert h.expected_wait_s(2) == 1.0  # one ahead of it, two slots
    assert h.expected_wait_s(15) == 14.0


async def test_a_burst_on_a_fast_model_queues_and_a_slow_queue_is_refused_with_its_wait():
    h = _host(queue_time_s=30.0)
    h.service_s = 1.0
    try:
        _running(h, 15)
        job = _idle()
        h._admit(job)  # the 16th of a burst on 2 slots: 7 s of wait, under 30 s
        assert len(h._tasks) == 16
        h.service_s = 5.0  # the same queue, of slow jobs: 15 ahead on 2 slots, 37.5 s
        late = _idle()
        with pytest.raises(BusError) as err:
            h._admit(late)
        late.close()
        assert err.value.code == "busy" and err.value.retryable and err.value.retry_after_s == 37.5
        assert "queue_time_s" in err.value.message
        assert err.value.to_reply().retry_after_s == 37.5  # on the wire, for the gateway's Retry-After
    finally:
        for t in list(h._tasks):
            t.cancel()


async def test_without_a_budget_the_default_applies_and_the_hard_limit_still_holds():
    h = _host(queue_limit=4)
    h.service_s = DEFAULT_QUEUE_TIME_S  # a minute a job
    try:
        _running(h, 2)
        h._admit(_idle())  # half a minute ahead of it
        _running(h, 1)
        with pytest.raises(BusError) as err:
            extra = _idle()
            try:
                h._admit(extra)
            finally:
                extra.close()
        assert "4 requests are running or queued" in err.value.message and err.value.retry_after_s is not None
    finally:
        for t in list(h._tasks):
            t.cancel()
