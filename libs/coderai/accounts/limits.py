"""Per-key limits enforced in Redis, so every gateway replica sees the same counts.

Rates use GCRA (a token bucket kept as one timestamp per key, updated by a Lua script on Redis's clock,
atomic across replicas): `rpm` admits a burst of `rpm` requests and then one every 60/rpm seconds; `tpm` is checked before a
request (a key in debt waits) and charged with the request's real tokens after it. Budgets are dollars spent in
the current period (hour, day, week or month, UTC), checked before a request and charged after it; concurrent
requests may overshoot a budget by what they spend in flight (the pod broker, which rents by the hour, reserves
instead).
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

    async def _gcra(self, key: str, per_minute: int, cost: float, mode: str) -> float:
        # the clock is Redis's own (TIME inside the script): every replica measures against the same one
        wait_ms = await self.gcra(keys=[key], args=[60_000 / per_minute, per_minute, cost, mode])
        return float(wait_ms) / 1000

    async def admit(self, name: str, rpm: int, tpm: int, budget_usd: float, period: str) -> None:
        """Raise Limited unless the key may start a request now (and count the request against `rpm`)."""
        if tpm:
            wait = await self._gcra(f"coderai:rl:{name}:tpm", tpm, 0, "check")
            if wait > 0:
                raise Limited(f"tokens-per-minute limit of {tpm}", wait)
        if budget_usd:
            pid, end = period_id(period, time.time())
            spent = float(await self.redis.get(f"coderai:spend:{name}:{pid}") or 0)
            if spent >= budget_usd:
                raise Limited(f"{period}ly budget of ${budget_usd:g} (spent ${spent:.4f})", end - time.time())
        if rpm:
            wait = await self._gcra(f"coderai:rl:{name}:rpm", rpm, 1, "take")
            if wait > 0:
                raise Limited(f"requests-per-minute limit of {rpm}", wait)

    async def charge(self, name: str, tokens: int, tpm: int, cost_usd: float, period: str) -> None:
        """After a request: its tokens against `tpm`, its cost against the budget period."""
        if tpm and tokens:
            await self._gcra(f"coderai:rl:{name}:tpm", tpm, tokens, "add")
        if cost_usd > 0:
            pid, end = period_id(period, time.time())
            key = f"coderai:spend:{name}:{pid}"
            pipe = self.redis.pipeline(transaction=False)
            pipe.incrbyfloat(key, cost_usd)
            pipe.expireat(key, int(end) + 86400)
            await pipe.execute()
