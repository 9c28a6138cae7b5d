"""Per-key limits enforced in Redis, so every gateway replica sees the same counts.

Rates use GCRA (a token bucket kept as one timestamp per key, updated by a Lua script on Redis's clock,
atomic across replicas): `rpm` admits a burst of `rpm` requests and then one every 60/rpm seconds; `tpm` is checked before a
request (a key in debt waits) and charged with the request's real tokens after it. Budgets are dollars spent in
the current period (hour, day, week or month, UTC): a request reserves its estimated cost atomically before it
starts (refused if spent + reserved + estimate would pass the budget), and settles at its real cost when it
ends, so concurrent requests on any replica cannot together overshoot, as long as estimates are not below real
costs (the gateway estimates generously: see `gateway/accounting.py:estimate_cost`).
"""

from __future__ import annotations

import calendar
import time
from dataclasses import dataclass
from typing import Any

GCRA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local interval, burst, cost, mode = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
if mode == 'check' then
  local wait = tat - interval * burst - now
  if wait > 0 then return wait end
  return 0
end
local new_tat = tat + interval * cost
if mode == 'take' then
  local wait = new_tat - interval * burst - now
  if wait > 0 then return wait end
end
redis.call('SET', KEYS[1], new_tat, 'PX', math.ceil(new_tat - now) + 1000)
return 0
"""


RESERVE = """
local spent = tonumber(redis.call('GET', KEYS[1]) or '0')
local reserved = tonumber(redis.call('GET', KEYS[2]) or '0')
local budget, estimate = tonumber(ARGV[1]), tonumber(ARGV[2])
if spent + reserved + estimate > budget then return tostring(spent + reserved) end
redis.call('INCRBYFLOAT', KEYS[2], estimate)
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 'ok'
"""

RESERVED_TTL_S = 600  # a reservation nobody refreshes (its gateway died) is forgotten after this
REFRESH_EVERY_S = RESERVED_TTL_S / 4  # how often a running request refreshes its reservation

SETTLE = """
redis.call('INCRBYFLOAT', KEYS[2], -tonumber(ARGV[1]))
if tonumber(ARGV[2]) > 0 then
  redis.call('INCRBYFLOAT', KEYS[1], ARGV[2])
  redis.call('EXPIREAT', KEYS[1], ARGV[3])
end
return 'ok'
"""


@dataclass(frozen=True)
class Reservation:
    """Budget held for one running request, in the period it was made in (a request that runs past the end of its
    period releases it there, not in the next one)."""

    name: str
    period_id: str
    estimate_usd: float

    @property
    def key(self) -> str:
        return f"coderai:reserved:{self.name}:{self.period_id}"


@dataclass(frozen=True)
class Limited(Exception):
    """A limit was hit: `retry_after_s` until it would pass, `what` for the message."""

    what: str
    retry_after_s: float


def period_id(period: str, now: float) -> tuple[str, float]:
    """The period's id and its end (unix seconds), UTC."""
    t = time.gmtime(now)
    if period == "hour":
        start = calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, t.tm_hour, 0, 0))
        return time.strftime("%Y%m%d%H", t), start + 3600
    if period == "day":
        start = calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0))
        return time.strftime("%Y%m%d", t), start + 86400
    if period == "week":
        start = calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0)) - t.tm_wday * 86400
        return time.strftime("%G-W%V", t), start + 7 * 86400
    if period == "month":
        year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
        return time.strftime("%Y%m", t), calendar.timegm((year, month, 1, 0, 0, 0))
    raise ValueError(f"unknown budget period {period!r}")


class Limiter:
    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.gcra = redis.register_script(GCRA)
        self.reserve = redis.register_script(RESERVE)
        self.settle = redis.register_script(SETTLE)

    async def _gcra(self, key: str, per_minute: int, cost: float, mode: str) -> float:
        # the clock is Redis's own (TIME inside the script): every replica measures against the same one
        wait_ms = await self.gcra(keys=[key], args=[60_000 / per_minute, per_minute, cost, mode])
        return float(wait_ms) / 1000

    async def admit(self, name: str, rpm: int, tpm: int, budget_usd: float, period: str,
                    estimate_usd: float = 0.0) -> Reservation | None:
        """Raise Limited unless the key may start a request now; counts the request against `rpm` and reserves
        `estimate_usd` of the budget: the reservation to `refresh` while the request runs and give to `charge`
        when it ends (None without a budget)."""
        if tpm:
            wait = await self._gcra(f"coderai:rl:{name}:tpm", tpm, 0, "check")
            if wait > 0:
                raise Limited(f"tokens-per-minute limit of {tpm}", wait)
        if rpm:
            wait = await self._gcra(f"coderai:rl:{name}:rpm", rpm, 1, "take")
            if wait > 0:
                raise Limited(f"requests-per-minute limit of {rpm}", wait)
        if budget_usd:
            pid, end = period_id(period, time.time())
            held = Reservation(name, pid, estimate_usd)
            got = await self.reserve(keys=[f"coderai:spend:{name}:{pid}", held.key],
                                     args=[budget_usd, estimate_usd, RESERVED_TTL_S])
            if got != b"ok" and got != "ok":
                raise Limited(f"{period}ly budget of ${budget_usd:g} (spent and reserved ${float(got):.4f})", end - time.time())
            return held
        return None

    async def refresh(self, held: Reservation) -> None:
        """Keep a running request's reservation from expiring (it would otherwise after RESERVED_TTL_S)."""
        await self.redis.expire(held.key, RESERVED_TTL_S)

    async def charge(self, name: str, tokens: int, tpm: int, cost_usd: float, period: str,
                     held: Reservation | None = None) -> None:
        """After a request: its tokens against `tpm`; its reservation released (in the period it was made in) and
        its real cost spent (in the period it ends in)."""
        if tpm and tokens:
            await self._gcra(f"coderai:rl:{name}:tpm", tpm, tokens, "add")
        if held is not None or cost_usd > 0:
            pid, end = period_id(period, time.time())
            await self.settle(keys=[f"coderai:spend:{name}:{pid}", held.key if held else f"coderai:reserved:{name}:{pid}"],
                              args=[held.estimate_usd if held else 0, cost_usd, int(end) + 86400])
