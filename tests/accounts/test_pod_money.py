"""Pod money in the session's real Redis: caps, reservations under concurrency, booking, the ledger, restarts."""

from __future__ import annotations

import asyncio
import calendar
import random
from decimal import Decimal

import pytest
import redis.asyncio as aioredis

from coderai.accounts.pod_money import Caps, OverBudget, Pod, PodMoney, ReservationError, live

T = calendar.timegm((2026, 11, 29, 10, 0, 0))  # a Sunday, 10:00 UTC
MIDNIGHT = calendar.timegm((2026, 11, 30, 0, 0, 0))  # a Monday, the last day of the month
CAPS = Caps(budget_usd=5.0, period="day", global_budget_usd=50.0, global_period="month", global_max_hourly_usd=10.0)


@pytest.fixture
async def r(redis_server):
    # a bounded pool: a thousand concurrent calls queue for 32 connections instead of opening a thousand. They wait
    # as long as it takes: with a thousand tasks on this loop, a connect's 5 s default (redis-py's) and the pool's
    # 20 s wait were both reached on a loaded 2-core machine ("Timeout connecting to server", no finding about the
    # money: the loop had not come round to it); the test's own timeout bounds a real hang
    pool = aioredis.BlockingConnectionPool.from_url(
        redis_server.url, max_connections=32, timeout=None, socket_connect_timeout=120, socket_timeout=120
    )
    client = aioredis.Redis(connection_pool=pool)
    yield client
    await client.aclose()


@pytest.fixture
def money(r, unique) -> PodMoney:
    return PodMoney(r, prefix=f"test:{unique}:pods")


async def shuffle_yield(rng: random.Random) -> None:
    """Give the loop to other tasks a random number of times (no clock involved), to vary the interleaving: each
    turn awaits a future the loop resolves on its next pass, after the tasks already ready have run."""
    loop = asyncio.get_running_loop()
    for _ in range(rng.randrange(4)):
        turn = loop.create_future()
        loop.call_soon(turn.set_result, None)
        await turn


async def test_reserve_open_extend_book(money):
    res = await money.reserve("big", "p1", 0.44 * 3, 0.66, CAPS, T)
    assert (res.model, res.rate_hr, res.amount_usd, res.until) == ("big", 1.32, 0.66, T + 1800)
    assert await money.reserved("big", "day", T) == 0.66 and await money.reserved(None, "month", T) == 0.66
    assert await money.running_rate() == 1.32
    await money.open_pod("p1", "A40", T)
    assert await money.pods() == [Pod("p1", "big", "A40", 1.32, T)]
    assert live((await money.pods())[0], T + 1234) == 0.452467

    more = await money.extend(res, 0.33, T + 100, CAPS)
    assert (more.amount_usd, more.until) == (0.99, T + 2700)
    assert await money.reservation("p1") == more
    with pytest.raises(ReservationError):
        await money.extend(res, 0.33, T + 100, CAPS)  # stale: `more` replaced it

    entry = await money.book("p1", "big", "A40", 1.32, T, T + 1234, T + 1240)
    assert (entry.seconds, entry.usd, entry.usd_micro) == (1234, 0.452467, 452467)
    for period in ("hour", "day", "week", "month"):
        assert await money.spend("big", period, T) == 0.452467
        assert await money.spend(None, period, T) == 0.452467
    assert await money.reserved("big", "day", T) == 0 and await money.reserved(None, "month", T) == 0
    assert await money.running_rate() == 0 and await money.pods() == [] and await money.reservation("p1") is None
    [row] = await money.ledger()
    assert (row.pod_id, row.model, row.gpu, row.rate_hr, row.start, row.end, row.seconds, row.usd) == (
        "p1",
        "big",
        "A40",
        1.32,
        T,
        T + 1234,
        1234,
        0.452467,
    )
    with pytest.raises(ReservationError):
        await money.extend(more, 0.1, T + 1300, CAPS)
    with pytest.raises(ReservationError):
        await money.reserve("big", "p1", 1.32, 0.1, CAPS, T + 1300)


async def test_release_and_open_without_reservation(money):
    await money.reserve("m", "p1", 1.0, 0.5, CAPS, T)
    assert await money.release("p1") is True and await money.release("p1") is False
    assert await money.reserved("m", "day", T) == 0 and await money.running_rate() == 0
    with pytest.raises(ReservationError):
        await money.open_pod("p1", "A40", T)


def test_live_is_rate_times_elapsed():
    pod = Pod("p", "m", "A40", 0.79 * 2, T)
    assert live(pod, T) == 0 and live(pod, T - 5) == 0
    assert live(pod, T + 3600) == 1.58 and live(pod, T + 1) == 0.000439


async def test_model_budget_refuses_naming_model_budget_and_reset(money):
    caps = Caps(budget_usd=5.0, period="day")
    await money.reserve("big", "p1", 100.0, 4.99, caps, T)
    with pytest.raises(OverBudget) as e:
        await money.reserve("big", "p2", 100.0, 0.02, caps, T)
    err = e.value
    assert (err.what, err.model, err.limit_usd, err.resets_at) == ("budget", "big", 5.0, MIDNIGHT)
    assert "model 'big'" in str(err) and "$5.00 day budget" in str(err)
    assert "resets at 2026-11-30 00:00 UTC" in str(err)
    assert await money.reserved("big", "day", T) == 4.99 and await money.running_rate() == 100.0  # nothing taken
    await money.reserve("big", "p3", 100.0, 0.01, caps, T)  # exactly the budget is allowed
    with pytest.raises(OverBudget, match="model 'big'"):
        await money.extend(await money.reservation("p1"), 0.000001, T, caps)
    await money.reserve("big", "p4", 100.0, 1.0, caps, MIDNIGHT)  # a new day


async def test_zero_budget_allows_nothing(money):
    with pytest.raises(OverBudget) as e:
        await money.reserve("m", "p1", 1.0, 0.000001, Caps(budget_usd=0.0, period="hour"), T)
    assert e.value.what == "budget" and "$0.00 hour budget" in str(e.value) and "2026-11-29 11:00 UTC" in str(e.value)


async def test_global_budget_refuses_across_models(money):
    caps = Caps(global_budget_usd=10.0, global_period="month")
    await money.reserve("a", "p1", 50.0, 6.0, caps, T)
    with pytest.raises(OverBudget) as e:
        await money.reserve("b", "p2", 50.0, 5.0, caps, T)
    err = e.value
    assert (err.what, err.model, err.limit_usd) == ("global_budget", "b", 10.0)
    assert err.resets_at == calendar.timegm((2026, 12, 1, 0, 0, 0))
    assert "model 'b'" in str(err) and "global $10.00 month budget" in str(err) and "2026-12-01 00:00 UTC" in str(err)
    await money.reserve("b", "p2", 50.0, 4.0, caps, T)


async def test_running_rate_cap_and_per_pod_rate(money):
    caps = Caps(global_max_hourly_usd=3.0, max_hourly_usd=1.5)
    await money.reserve("m", "p1", 0.44 * 3, 0.1, caps, T)
    await money.reserve("m", "p2", 0.44 * 3, 0.1, caps, T)
    with pytest.raises(OverBudget) as e:
        await money.reserve("m", "p3", 0.44 * 3, 0.1, caps, T)
    assert (e.value.what, e.value.model, e.value.limit_usd, e.value.resets_at) == ("global_hourly", "m", 3.0, None)
    assert "model 'm'" in str(e.value) and "$3.00/h" in str(e.value) and "$2.64/h running" in str(e.value)
    with pytest.raises(OverBudget) as e:
        await money.reserve("m", "p4", 1.6, 0.1, caps, T)
    assert e.value.what == "max_hourly" and "model 'm'" in str(e.value) and "$1.50/h" in str(e.value)
    await money.book("p1", "m", "A40", 1.32, T, T + 60, T + 60)
    await money.reserve("m", "p3", 1.32, 0.1, caps, T + 60)
    # a lowered cap stops extensions of pods already counted
    with pytest.raises(OverBudget, match="global cap of \\$2.00/h"):
        await money.extend(await money.reservation("p2"), 0.1, T + 60, Caps(global_max_hourly_usd=2.0))


@pytest.mark.parametrize("seed", range(5))
async def test_concurrent_equal_reservations_grant_exactly_floor(money, seed):
    rng = random.Random(seed)
    caps = Caps(budget_usd=5.0, period="day", global_budget_usd=100.0, global_period="week")

    async def one(i: int) -> bool:
        await shuffle_yield(rng)
        try:
            await money.reserve("small", f"p{i}", 1.0, 0.013, caps, T)
            return True
        except OverBudget:
            return False

    granted = sum(await asyncio.gather(*(one(i) for i in rng.sample(range(1000), 1000))))
    assert granted == 384  # floor(5.00 / 0.013)
    assert await money.reserved("small", "day", T) == pytest.approx(4.992, abs=1e-9)
    assert await money.running_rate() == 384.0


@pytest.mark.parametrize("seed", range(5))
async def test_concurrent_random_reservations_and_bookings_never_overshoot(money, seed):
    rng = random.Random(seed)
    caps = {
        "a": Caps(budget_usd=3.0, global_budget_usd=5.0, global_period="month"),
        "b": Caps(budget_usd=4.0, global_budget_usd=5.0, global_period="month"),
    }
    granted: dict[str, int] = {"a": 0, "b": 0}

    async def one(i: int) -> None:
        model, amount = rng.choice("ab"), rng.randrange(1_000, 50_000) / 1e6
        await shuffle_yield(rng)
        try:
            await money.reserve(model, f"p{i}", 1.0, amount, caps[model], T)
        except OverBudget:
            return
        granted[model] += round(amount * 1e6)
        await shuffle_yield(rng)
        if rng.random() < 0.5:  # it ran at most as long as reserved, and was booked
            await money.book(f"p{i}", model, "A40", 1.0, T, T + int(amount * 3600), T + 60)
            granted[model] -= round(amount * 1e6) - round(int(amount * 3600) / 3600 * 1e6)

    await asyncio.gather(*(one(i) for i in range(1000)))
    used = {}
    for m, limit in (("a", 3.0), ("b", 4.0)):
        used[m] = await money.spend(m, "day", T) + await money.reserved(m, "day", T)
        assert used[m] <= limit + 1e-9
        assert round(used[m] * 1e6) == granted[m]  # counters hold exactly what was granted and booked
    total = await money.spend(None, "month", T) + await money.reserved(None, "month", T)
    assert total <= 5.0 + 1e-9 and total > 4.9  # full: small amounts fill it
    assert await money.ledger_total_usd() == await money.spend(None, "month", T)


@pytest.mark.parametrize("seed", range(3))
async def test_running_rate_cap_holds_under_concurrency(money, seed):
    rng = random.Random(seed)
    caps = Caps(global_max_hourly_usd=10.0)
    granted: dict[str, float] = {}

    async def one(pod_id: str, rate: float) -> None:
        await shuffle_yield(rng)
        try:
            await money.reserve("m", pod_id, rate, 0.01, caps, T)
            granted[pod_id] = rate
        except OverBudget as e:
            assert e.what == "global_hourly"

    await asyncio.gather(*(one(f"a{i}", 0.44) for i in range(1000)))
    assert len(granted) == 22 and await money.running_rate() == 9.68  # floor(10 / 0.44) pods
    for pod_id in list(granted):  # stop them all, then race pods at random rates for the freed room
        await money.book(pod_id, "m", "A40", 0.44, T, T + 1, T + 1)
        del granted[pod_id]
    await asyncio.gather(*(one(f"b{i}", rng.randrange(5, 300) / 100) for i in range(1000)))
    running = await money.running_rate()
    assert 9.9 < running <= 10.0 and round(running * 1e6) == sum(round(x * 1e6) for x in granted.values())


async def test_booking_is_idempotent(money):
    await money.reserve("m", "p1", 1.0, 1.0, CAPS, T)
    books = await asyncio.gather(*(money.book("p1", "m", "A40", 1.0, T, T + 900, T + 900) for _ in range(20)))
    assert sum(b is not None for b in books) == 1
    assert await money.book("p1", "m", "A40", 1.0, T, T + 900, T + 901) is None
    assert len(await money.ledger()) == 1 and await money.spend("m", "day", T) == 0.25
    assert await money.reserved("m", "day", T) == 0 and await money.running_rate() == 0


async def test_ledger_total_is_rate_times_seconds_to_the_cent(money):
    pods = [
        (0.44 * 3, 1234),
        (0.79 * 2, 3599.5),
        (3.89, 1),
        (0.17, 86_401),
        (2.99 * 8, 7),
        (0.44 * 3, 1234),
        (1.19, 0.25),
        (0.0, 100),
        (0.39 * 4, 12_345),
    ]
    for i, (rate, seconds) in enumerate(pods):
        await money.book(f"p{i}", "m", "A40", rate, T + i, T + i + seconds, T + 90_000)
    expected = sum(Decimal(repr(rate)) * Decimal(repr(s)) / 3600 for rate, s in pods)
    total = await money.ledger_total_usd()
    assert abs(Decimal(repr(total)) - expected) < Decimal("0.005")
    assert abs(Decimal(repr(total)) - expected) <= Decimal("0.000001") * len(pods)  # each rounded to a micro-dollar
    assert await money.spend(None, "month", T) == total
    assert len(await money.ledger()) == len(pods)
    page = await money.ledger(count=4)
    rest = await money.ledger(since=page[-1].id)
    assert [e.pod_id for e in page + rest] == [f"p{i}" for i in range(len(pods))]


async def test_new_instance_over_same_redis_sees_same_state(money, redis_server):
    await money.reserve("m", "p1", 1.32, 0.66, CAPS, T)
    await money.open_pod("p1", "A40", T)
    await money.reserve("m", "p2", 0.5, 0.5, CAPS, T)
    await money.book("p2", "m", "A6000", 0.5, T, T + 720, T + 720)
    fresh_client = aioredis.from_url(redis_server.url)
    try:
        again = PodMoney(fresh_client, prefix=money.p)
        for period in ("hour", "day", "week", "month"):
            assert await again.spend("m", period, T) == await money.spend("m", period, T) == 0.1
        assert await again.reserved("m", "day", T) == 0.66 and await again.running_rate() == 1.32
        assert await again.pods() == await money.pods() and await again.ledger() == await money.ledger()
        assert await again.ledger_total_usd() == 0.1
        assert await again.book("p2", "m", "A6000", 0.5, T, T + 720, T + 999) is None  # still booked once
        res = await again.extend(await again.reservation("p1"), 0.66, T + 60, CAPS)
        assert (await money.reservation("p1")) == res and res.amount_usd == 1.32
    finally:
        await fresh_client.aclose()


async def test_periods_roll(money):
    caps = Caps(budget_usd=1.0, period="day")
    for pod_id, start in (("p1", T), ("p2", T + 3600)):
        await money.reserve("m", pod_id, 1.0, 0.5, caps, start)
        await money.book(pod_id, "m", "A40", 1.0, start, start + 1800, start + 1800)
    assert await money.spend("m", "hour", T) == 0.5 and await money.spend("m", "hour", T + 3600) == 0.5
    assert await money.spend("m", "hour", T + 7200) == 0
    assert await money.spend("m", "day", T) == 1.0 and await money.spend(None, "week", T) == 1.0
    with pytest.raises(OverBudget, match="resets at 2026-11-30 00:00 UTC"):
        await money.reserve("m", "p3", 1.0, 0.01, caps, T + 7200)
    await money.reserve("m", "p3", 1.0, 0.01, caps, MIDNIGHT + 60)  # the next day starts empty
    assert await money.spend("m", "day", MIDNIGHT + 60) == 0 and await money.spend("m", "week", MIDNIGHT + 60) == 0
    assert await money.spend("m", "month", MIDNIGHT + 60) == 1.0
    assert await money.spend("m", "month", calendar.timegm((2026, 12, 1, 0, 0, 0))) == 0


async def test_booking_across_midnight_is_split_between_periods(money):
    start = MIDNIGHT + 86_400 - 1800  # Nov 30 23:30 -> Dec 1 00:30: a new hour, day and month, same week
    await money.book("p1", "m", "A40", 1.0, start, start + 3600, start + 3600)
    for period in ("hour", "day", "month"):
        assert await money.spend("m", period, start) == 0.5 and await money.spend("m", period, start + 3600) == 0.5
    assert await money.spend("m", "week", start) == 1.0
    entry = await money.book("p2", "m", "A40", 0.44 * 3, start - 1, start + 3601, start + 3601)
    parts = [await money.spend("m", "day", t) for t in (start, start + 3600)]
    assert round(sum(parts) * 1e6) == 1_000_000 + entry.usd_micro  # the shares add up to the charge exactly


async def test_reservation_window_is_held_in_the_periods_it_covers(money):
    caps = Caps(budget_usd=1.0, period="hour")
    half_past = T + 1800
    await money.reserve("m", "p1", 1.2, 1.0, caps, half_past)  # 50 minutes: 30 in this hour, 20 in the next
    assert await money.reserved("m", "hour", T) == 0.6 and await money.reserved("m", "hour", T + 3600) == 0.4
    with pytest.raises(OverBudget) as e:
        await money.reserve("m", "p2", 1.2, 0.5, caps, half_past)
    assert e.value.resets_at == T + 3600
    with pytest.raises(OverBudget) as e:  # 1 minute fits this hour, the next 34 do not fit the next
        await money.reserve("m", "p3", 1.2, 0.7, caps, T + 3540)
    assert e.value.resets_at == T + 7200 and "resets at 2026-11-29 12:00 UTC" in str(e.value)
    await money.book("p1", "m", "A40", 1.2, half_past, half_past + 600, half_past + 600)
    assert await money.reserved("m", "hour", T + 3600) == 0 and await money.spend("m", "hour", T) == 0.2
