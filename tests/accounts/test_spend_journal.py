"""Budgets' spend and the pod ledger outlive their Redis: a key's spend is summed again from the EVENTS stream's
`request.completed` events, the pod ledger and its spend per period are booked again from the `coderai_pod_ledger`
journal, and the broker reserves a running pod again. Each comes back once: a second restore, or a Redis that was
never lost, adds nothing. Real nats-server and redis-server of the test's own; "losing Redis" is a FLUSHALL."""

from __future__ import annotations

import calendar
import secrets
import time
from types import SimpleNamespace

import pytest

from coderai.accounts.limits import SPEND_MARK, Limited, Limiter, SpendHistory, period_id
from coderai.accounts.pod_money import Booking, Caps, OverBudget, PodJournal, PodMoney
from coderai.contracts import ModelConfig, RequestCompleted
from coderai.contracts.models import PodPolicy
from coderai.contracts.pods import PodInfo
from coderai.contracts.subjects import EVT_REQUEST_COMPLETED
from coderai.contracts.topology import EVENTS, PODS
from coderai.pod_broker.service import Broker
from coderai.pod_broker.settings import BrokerSettings
from coderai.runtime.settings import load_settings

T = calendar.timegm((2026, 11, 29, 10, 0, 0))  # a Sunday, 10:00 UTC
MIDNIGHT = calendar.timegm((2026, 11, 30, 0, 0, 0))  # a Monday: a new day and a new week


# --- budgets' spend ----------------------------------------------------------------------------------


async def spend_request(limiter: Limiter, bus, name: str, cost: float) -> None:
    """One request of key `name` costing `cost` against its $1 daily budget, as the gateway accounts it: reserved,
    charged, and its `request.completed` published to EVENTS."""
    held = await limiter.admit(name, 0, 0, 1.0, "day", 0.05)
    await limiter.charge(name, 0, 0, cost, "day", held)
    e = RequestCompleted(
        request_id=secrets.token_hex(12),
        ts=time.time(),
        key_name=name,
        model="m",
        op="chat",
        status="ok",
        http_status=200,
        cost_usd=cost,
    )
    await bus.js.publish(
        EVT_REQUEST_COMPLETED(), EVT_REQUEST_COMPLETED.encode(e), headers={"Nats-Msg-Id": e.request_id}
    )


async def spent(r, name: str, period: str) -> float:
    return float(await r.get(f"coderai:spend:{name}:{period_id(period, time.time())[0]}") or 0)


async def test_an_over_budget_key_stays_over_budget_after_redis_is_lost(own_bus, own_redis):
    r = own_redis
    await own_bus.ensure_stream(EVENTS)
    limiter = Limiter(r, SpendHistory(own_bus))
    for cost in (0.5, 0.45):
        await spend_request(limiter, own_bus, "alice", cost)
    await spend_request(limiter, own_bus, "bob", 0.1)
    with pytest.raises(Limited, match="budget"):
        await limiter.admit("alice", 0, 0, 1.0, "day", 0.1)
    assert await spent(r, "alice", "day") == pytest.approx(0.95)

    await r.flushall()  # a new, empty Redis
    with pytest.raises(Limited, match="budget"):  # summed again from EVENTS before the budget is checked
        await limiter.admit("alice", 0, 0, 1.0, "day", 0.1)
    assert await spent(r, "alice", "day") == pytest.approx(0.95)
    assert await spent(r, "alice", "month") == pytest.approx(0.95)  # every period kind: the key's record says which
    assert await spent(r, "bob", "day") == pytest.approx(0.1)

    # once: a second restore, by this gateway or another, adds nothing, and neither does a Redis that kept it
    assert await limiter.restore() == 0
    assert await Limiter(r, SpendHistory(own_bus)).restore() == 0
    await spend_request(limiter, own_bus, "bob", 0.2)
    assert await spent(r, "alice", "day") == pytest.approx(0.95) and await spent(r, "bob", "day") == pytest.approx(0.3)


async def test_a_charge_into_an_emptied_redis_restores_first(own_bus, own_redis):
    """A request admitted in the lost Redis and ending in the new one: the spend comes back, then its cost is
    added; its reservation, which the new Redis never held, is released from nothing (no negative reservation)."""
    r = own_redis
    await own_bus.ensure_stream(EVENTS)
    limiter = Limiter(r, SpendHistory(own_bus))
    await spend_request(limiter, own_bus, "carol", 0.3)
    held = await limiter.admit("carol", 0, 0, 1.0, "day", 0.5)
    await r.flushall()
    await limiter.charge("carol", 0, 0, 0.2, "day", held)
    assert await spent(r, "carol", "day") == pytest.approx(0.5)
    assert await r.get(held.key) is None
    assert await r.exists(SPEND_MARK)


async def test_a_kept_redis_from_before_the_mark_is_not_counted_twice(own_bus, own_redis):
    """A Redis that kept its spend but was written before the mark existed: the restore leaves its counters."""
    r = own_redis
    await own_bus.ensure_stream(EVENTS)
    limiter = Limiter(r, SpendHistory(own_bus))
    await spend_request(limiter, own_bus, "dave", 0.4)
    await r.delete(SPEND_MARK)
    await spend_request(limiter, own_bus, "dave", 0.1)
    assert await spent(r, "dave", "day") == pytest.approx(0.5)


# --- the pod ledger ----------------------------------------------------------------------------------


async def snapshot(money: PodMoney) -> tuple:
    """Everything booked: the ledger entries (but their stream ids), the booked set and every spent counter."""
    entries = [
        (e.pod_id, e.model, e.gpu, e.rate_hr, e.start, e.end, e.seconds, e.usd_micro) for e in await money.ledger()
    ]
    counters = {}
    async for key in money.redis.scan_iter(match=f"{money.p}:spent:*"):
        counters[key] = await money.redis.hgetall(key)
    return entries, await money.redis.smembers(f"{money.p}:booked"), counters


async def test_the_pod_ledger_and_its_spend_come_back_once(own_bus, own_redis):
    r = own_redis
    money = PodMoney(r, journal=PodJournal(own_bus))
    assert await money.restore() == 0  # an empty journal: only the mark
    for pod, model, rate, start, end in (
        ("p1", "big", 1.32, T, T + 1234),
        ("p2", "small", 0.44, MIDNIGHT - 600, MIDNIGHT + 900),  # a new day and week
        ("p3", "big", 2.0, MIDNIGHT + 60, MIDNIGHT + 3700),
    ):
        await money.reserve(model, pod, rate, rate / 2, Caps(), start)
        await money.open_pod(pod, "A40", start)
        assert await money.book(pod, model, "A40", rate, start, end, end) is not None
    assert await money.book("p1", "big", "A40", 1.32, T, T + 9999, T + 9999) is None  # a retried end books once
    before = await snapshot(money)
    assert len(before[0]) == 3 and await money.spend("big", "week", T) == pytest.approx(0.452467)

    await r.flushall()  # a new, empty Redis; a restarted broker binds it again
    again = PodMoney(r, journal=PodJournal(own_bus))
    assert await again.restore() == 3
    assert await snapshot(again) == before
    assert await again.restore() == 0  # its mark is there
    assert await PodMoney(r, journal=PodJournal(own_bus)).restore() == 0  # a new broker's full pass: booked already
    assert await snapshot(again) == before


async def test_an_emptied_redis_reserves_nothing_before_the_ledger_is_back(own_bus, own_redis):
    r = own_redis
    money = PodMoney(r, journal=PodJournal(own_bus))
    caps = Caps(budget_usd=1.0, period="day")
    await money.reserve("big", "p1", 3.6, 0.9, caps, T)
    await money.book("p1", "big", "A40", 3.6, T, T + 900, T + 900)  # $0.90 of the day's $1
    await r.flushall()
    with pytest.raises(OverBudget):  # the same object, as the running broker: the ledger back before the cap
        await money.reserve("big", "p2", 3.6, 0.2, caps, T + 1000)
    assert await money.spend("big", "day", T) == pytest.approx(0.9)


async def test_a_booking_journalled_but_not_in_redis_is_booked_at_the_restart(own_bus, own_redis):
    """The broker died between the journal and Redis: its next start books it, as journalled, and a retried end
    with a later time bills what was journalled first."""
    r = own_redis
    journal = PodJournal(own_bus)
    money = PodMoney(r, journal=journal)
    await money.restore()
    await journal.keep(
        Booking(pod_id="p9", model="big", gpu="A40", rate_micro=3_600_000, start=T, end=T + 100, booked_at=T + 100)
    )
    assert await money.restore() == 0 and await money.ledger() == []  # Redis kept its mark: nothing to do at run time
    restarted = PodMoney(r, journal=journal)
    assert await restarted.restore() == 1
    assert [(e.pod_id, e.usd) for e in await restarted.ledger()] == [("p9", 0.1)]

    await journal.keep(
        Booking(pod_id="p10", model="big", gpu="A40", rate_micro=3_600_000, start=T, end=T + 200, booked_at=T + 200)
    )
    entry = await restarted.book("p10", "big", "A40", 3.6, T, T + 5000, T + 5000)
    assert entry is not None and (entry.end, entry.usd) == (T + 200, 0.2)


async def test_the_broker_restores_the_ledger_and_reserves_a_running_pod_again(own_bus, own_redis):
    r = own_redis
    settings = load_settings(BrokerSettings, "pod-broker", env={}, max_hourly_usd=10.0, reserve_ahead_s=600.0)
    money = PodMoney(r, journal=PodJournal(own_bus))
    broker = Broker(settings, money=money)
    cfg = ModelConfig(
        name="big", engine="llama", path="/m.gguf", pod=PodPolicy(burst="when_busy", budget_usd=5.0, period="day")
    )
    broker.models = SimpleNamespace(values={"big": cfg})
    now = time.time()
    await money.reserve("big", "done", 3.6, 0.5, broker._caps(cfg), now - 1000)
    await money.book("done", "big", "A40", 3.6, now - 1000, now - 500, now - 500)  # $0.50 booked
    booked = await money.spend("big", "day")
    running = PodInfo(
        name="run",
        model="big",
        state="ready",
        pod_id="rp1",
        gpu_type="A40",
        hourly_usd=3.6,
        created_at=now - 300,
        reserved_usd=0.9,
    )
    await money.reserve("big", "run", 3.6, 0.9, broker._caps(cfg), now - 300)
    await money.open_pod("run", "A40", now - 300)

    await r.flushall()
    await broker.reconcile()  # no pods tracked: the ledger back, and nothing else
    assert await money.spend("big", "day") == booked
    assert await money.reservation("run") is None and await money.running_rate() == 0

    broker.kv = await own_bus.kv(PODS)
    await broker._keep_reserved(running, now)
    held = await money.reservation("run")
    assert held is not None and held.amount_usd == pytest.approx(0.3 + 0.6)  # 300 s run, 600 s ahead, at $3.60/h
    assert await money.running_rate() == 3.6 and [p.pod_id for p in await money.pods()] == ["run"]
    assert broker.pods["run"].reserved_usd == pytest.approx(0.9)
