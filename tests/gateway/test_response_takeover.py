"""A background response outlives nothing silently: its gateway touches its record while it runs, and one whose
gateway stopped (untouched for LOST_S) is marked failed by the first read after that, instead of reading
`in_progress` forever. A runner that was only slow then writes nothing more, and a cancel through another gateway
stops the work where it runs. On a real NATS (the session's nats-server)."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from coderai.gateway.auth import Caller
from coderai.gateway.openai import responses_store
from coderai.gateway.openai.responses_record import ResponseTenure, StoredResponse
from coderai.gateway.openai.responses_store import LOST_S, Responses
from coderai.runtime.lifecycle import wait_for

WHO = Caller("tenant", frozenset({"inference"}))


class _Keys:
    """The key store's answer about the one key, switched by the test (revocation itself is tested on a real stack:
    tests/integration/test_accounts.py)."""

    def __init__(self) -> None:
        self.is_revoked, self.asked = False, 0

    async def revoked(self, who: Caller) -> bool:
        self.asked += 1
        return self.is_revoked


def _responses(bus, keys: _Keys | None = None) -> Responses:
    return Responses(types.SimpleNamespace(bus=bus, auth=keys or _Keys(), redis=None))


async def _running(responses: Responses, rid: str, runner: str, touched_s_ago: float) -> int:
    rec = StoredResponse(
        id=rid,
        owner="tenant",
        created_at=time.time(),
        runner=runner,
        updated_at=time.time() - touched_s_ago,
        response={"id": rid, "object": "response", "background": True, "status": "in_progress"},
    )
    return await responses.put(rec)


async def test_a_response_whose_gateway_stopped_is_read_as_failed_and_its_runner_writes_nothing_more(bus, unique):
    responses = _responses(bus)
    rid = f"resp_{unique}"
    await _running(responses, rid, "gateway:4242:dead00", LOST_S + 1)
    got = await responses.get(WHO, rid)
    assert got.response["status"] == "failed" and "stopped before it finished" in got.response["error"]["message"]
    stored, _rev = await responses._entry(rid)
    assert stored.response["status"] == "failed" and stored.runner == ""  # written, not only answered
    assert (await responses.get(WHO, rid)).response == got.response
    # the runner was only slow: its answer comes after the record was failed, and is not written over it
    late = {"id": rid, "background": True, "status": "completed"}
    assert not await responses.update(rid, late, runner="gateway:4242:dead00")
    assert (await responses._entry(rid))[0].response["status"] == "failed"


@pytest.mark.parametrize("runner, touched_s_ago", [("gateway:1:live00", 1.0), ("", LOST_S + 1)])
async def test_a_live_response_and_one_from_before_runners_are_left_as_they_are(bus, unique, runner, touched_s_ago):
    responses = _responses(bus)
    await _running(responses, f"resp_{unique}", runner, touched_s_ago)
    assert (await responses.get(WHO, f"resp_{unique}")).response["status"] == "in_progress"


async def _held(responses: Responses, rid: str) -> tuple[asyncio.Event, asyncio.Event]:
    """A background response run by `responses` whose work waits until cancelled: (started, stopped)."""
    rec = StoredResponse(
        id=rid,
        owner="tenant",
        created_at=time.time(),
        runner=responses.me,
        updated_at=time.time(),
        response={"id": rid, "background": True, "status": "in_progress"},
    )
    tenure = ResponseTenure(await responses.kv(), rec, await responses.put(rec))
    started, stopped = asyncio.Event(), asyncio.Event()

    async def work() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            stopped.set()

    responses.run(tenure, work(), WHO)
    await asyncio.wait_for(started.wait(), 10)
    return started, stopped


async def test_the_running_gateway_touches_the_record_and_a_cancel_elsewhere_stops_its_work(bus, unique, monkeypatch):
    monkeypatch.setattr(responses_store, "REVOKE_CHECK_S", 0.05)
    here, elsewhere = _responses(bus), _responses(bus)
    rid = f"resp_{unique}"
    _started, stopped = await _held(here, rid)
    first = (await here._entry(rid))[0].updated_at

    async def touched() -> bool:
        return (await here._entry(rid))[0].updated_at > first

    await wait_for(touched, 10, what="the record touched while the work runs")
    assert not stopped.is_set()
    cancelled = await elsewhere.cancel(WHO, rid)  # another gateway process: its task is not there
    assert cancelled["status"] == "cancelled"
    await asyncio.wait_for(stopped.wait(), 10)  # the runner learns it at its next touch, and stops the work
    await wait_for(lambda: rid not in here.tasks, 10, what="the task gone")
    assert (await here._entry(rid))[0].response["status"] == "cancelled"


async def test_a_revoked_keys_background_response_is_cancelled(bus, monkeypatch, unique):
    monkeypatch.setattr(responses_store, "REVOKE_CHECK_S", 0.05)
    keys = _Keys()
    responses = _responses(bus, keys)
    rid = f"resp_{unique}"
    _started, stopped = await _held(responses, rid)
    await wait_for(lambda: keys.asked >= 2, 10, what="the key asked after while it runs")
    assert not stopped.is_set() and rid in responses.tasks  # still valid, still running
    keys.is_revoked = True
    await asyncio.wait_for(stopped.wait(), 10)
    rec, _ = await responses._entry(rid)
    print(f"background response of a revoked key: {rec.response['status']}, its task stopped")
    assert rec.response["status"] == "cancelled" and rid not in responses.tasks
