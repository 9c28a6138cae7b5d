"""Budget reservations on a real Redis: held in the period they were made in, released there even when the
request ends in the next one, and kept alive while a long request runs."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from coderai.accounts.limits import RESERVED_TTL_S, Limited, Limiter, Reservation, period_id


@pytest.fixture
async def redis(redis_server):
    r = aioredis.from_url(redis_server.url)
    yield r
    await r.aclose()


async def test_a_reservation_is_held_then_settled_at_the_real_cost(redis, unique):
    limiter = Limiter(redis)
    name = f"k-{unique}"
    held = await limiter.admit(name, 0, 0, 1.0, "day", 0.25)
    assert held is not None and held.period_id == period_id("day", time.time())[0]
    assert float(await redis.get(held.key)) == pytest.approx(0.25)
    with pytest.raises(Limited):  # 0.25 held + 0.8 > 1.0
        await limiter.admit(name, 0, 0, 1.0, "day", 0.8)
    await limiter.charge(name, 10, 0, 0.1, "day", held)
    assert float(await redis.get(held.key)) == pytest.approx(0.0)
    assert float(await redis.get(f"coderai:spend:{name}:{held.period_id}")) == pytest.approx(0.1)


async def test_a_reservation_from_an_earlier_period_is_released_there(redis, unique):
    """A request admitted just before midnight and ending after it: its reservation does not linger in the old
    day (blocking nothing, but counted) nor go negative in the new one."""
    limiter = Limiter(redis)
    name = f"k-{unique}"
    old = Reservation(name, "19990101", 0.5)
    await redis.set(old.key, 0.5)
    await limiter.charge(name, 0, 0, 0.2, "day", old)
    assert float(await redis.get(old.key)) == pytest.approx(0.0)
    today = period_id("day", time.time())[0]
    assert await redis.get(f"coderai:reserved:{name}:{today}") is None
    assert float(await redis.get(f"coderai:spend:{name}:{today}")) == pytest.approx(0.2)


async def test_refresh_keeps_a_running_reservation_from_expiring(redis, unique):
    limiter = Limiter(redis)
    held = await limiter.admit(f"k-{unique}", 0, 0, 1.0, "month", 0.1)
    assert held is not None
    await redis.expire(held.key, 5)  # as if the request had run for almost RESERVED_TTL_S already
    await limiter.refresh(held)
    assert RESERVED_TTL_S - 5 <= await redis.ttl(held.key) <= RESERVED_TTL_S


async def test_no_budget_holds_nothing(redis, unique):
    assert await Limiter(redis).admit(f"k-{unique}", 0, 0, 0.0, "day", 1.0) is None
