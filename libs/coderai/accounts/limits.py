"""Per-key limits enforced in Redis, so every gateway replica sees the same counts.

Rates use GCRA (a token bucket kept as one timestamp per key, updated by a Lua script on Redis's clock,
atomic across replicas): `rpm` admits a burst of `rpm` requests and then one every 60/rpm seconds; `tpm` is checked before a
request (a key in debt waits) and charged with the request's real tokens after it. Budgets are dollars spent in
the current period (hour, day, week or month, UTC): a request reserves its estimated cost atomically before it
starts (refused if spent + reserved + estimate would pass the budget), and settles at its real cost when it
ends, so concurrent requests on any replica cannot together overshoot, as long as estimates are not below real
costs (the gateway estimates generously: see `gateway/accounting.py:estimate_cost`).

Spend outlives Redis through the EVENTS stream: every charge is a `request.completed` event (key name, cost, time).
A Redis without the `SPEND_MARK` (emptied, or replaced by an empty one) refuses to reserve or settle until the
spend of the current hour, day, week and month of every key is summed from EVENTS and written back, once
(`Limiter.restore`). EVENTS keeps 7 days, so a week's or month's spend older than that is not rebuilt. Rate
windows are not: they are a minute long.
"""

from __future__ import annotations

import asyncio
import calendar
import time
from collections.abc import AsyncIterator
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


PERIODS = ("hour", "day", "week", "month")

SPEND_MARK = "coderai:spend_kept"
"""Set once this Redis holds every key's spend (restored, or never lost); a Redis without it lost the spend."""

RESERVE = """
if redis.call('EXISTS', KEYS[3]) == 0 then return 'lost' end
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
if redis.call('EXISTS', KEYS[3]) == 0 then return 'lost' end
-- a reservation this Redis does not hold (made in a lost one) is not released from others' reservations
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('INCRBYFLOAT', KEYS[2], -tonumber(ARGV[1])) end
if tonumber(ARGV[2]) > 0 then
  redis.call('INCRBYFLOAT', KEYS[1], ARGV[2])
  redis.call('EXPIREAT', KEYS[1], ARGV[3])
end
return 'ok'
"""


# KEYS: the mark, then spend counters; ARGV: each counter's amount and when it expires. A counter already higher
# (a Redis that kept its spend but predates the mark) is left as it is.
RESTORE = """
if not redis.call('SET', KEYS[1], '1', 'NX') then return 0 end
for i = 2, #KEYS do
  if tonumber(ARGV[2 * i - 3]) > tonumber(redis.call('GET', KEYS[i]) or '0') then
    redis.call('SET', KEYS[i], ARGV[2 * i - 3])
    redis.call('EXPIREAT', KEYS[i], ARGV[2 * i - 2])
  end
end
return #KEYS - 1
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


class SpendHistory:
    """The `request.completed` events of the EVENTS stream, on `bus`: what every charge was."""

    def __init__(self, bus: Any) -> None:
        self.bus = bus

    async def since(self, t: float, batch: int = 1000) -> AsyncIterator[Any]:
        """Every `request.completed` stored from `t` (unix seconds) up to the last one stored when asked, oldest
        first, through an ephemeral consumer without acks; none if there is no EVENTS stream."""
        from datetime import datetime, timezone

        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
        from nats.js.errors import NotFoundError

        from coderai.contracts import RequestCompleted
        from coderai.contracts.base import decode
        from coderai.contracts.subjects import EVT_REQUEST_COMPLETED
        from coderai.contracts.topology import EVENTS

        cfg = ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=datetime.fromtimestamp(t, timezone.utc),
        )
        try:
            sub = await self.bus.js.pull_subscribe(EVT_REQUEST_COMPLETED(), stream=EVENTS.name, config=cfg)
        except NotFoundError:
            return
        try:
            left = (await sub.consumer_info()).num_pending
            while left > 0:
                msgs = await sub.fetch(batch=min(batch, left), timeout=5)
                left -= len(msgs)
                for m in msgs:
                    yield decode(m.data, RequestCompleted)
        finally:
            await sub.unsubscribe()


class Limiter:
    """Rates and budgets over one Redis; `history` (optional) is where a lost Redis's spend is summed from."""

    def __init__(self, redis: Any, history: SpendHistory | None = None) -> None:
        self.redis = redis
        self.history = history
        self.gcra = redis.register_script(GCRA)
        self.reserve = redis.register_script(RESERVE)
        self.settle = redis.register_script(SETTLE)
        self._restore = redis.register_script(RESTORE)
        self._restoring = asyncio.Lock()

    async def restore(self) -> int:
        """Unless Redis holds `SPEND_MARK`: every key's spend in the current hour, day, week and month (each
        period kind, since a key's period is its record's to say), summed from `history`, written with the mark
        in one script, which only the first of several gateways gets to run. The counters written."""
        async with self._restoring:
            if await self.redis.exists(SPEND_MARK):
                return 0
            now = time.time()
            current = {period: period_id(period, now) for period in PERIODS}
            spent: dict[str, float] = {}
            ends: dict[str, float] = {}
            if self.history is not None:
                async for e in self.history.since(now - 31 * 86400):  # no current period started before
                    if e.cost_usd <= 0 or not e.key_name:
                        continue
                    for period, (pid, end) in current.items():
                        if period_id(period, e.ts)[0] == pid:
                            key = f"coderai:spend:{e.key_name}:{pid}"
                            spent[key] = spent.get(key, 0.0) + e.cost_usd
                            ends[key] = end
            args = [x for key in spent for x in (repr(spent[key]), int(ends[key]) + 86400)]
            return int(await self._restore(keys=[SPEND_MARK, *spent], args=args))

    async def _script(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run a reserving or settling script, after restoring the spend if it finds Redis lost it."""
        keys = [*keys, SPEND_MARK]
        got = await script(keys=keys, args=args)
        if got in (b"lost", "lost"):
            await self.restore()
            got = await script(keys=keys, args=args)
        return got

    async def _gcra(self, key: str, per_minute: int, cost: float, mode: str) -> float:
        # the clock is Redis's own (TIME inside the script): every replica measures against the same one
        wait_ms = await self.gcra(keys=[key], args=[60_000 / per_minute, per_minute, cost, mode])
        return float(wait_ms) / 1000

    async def admit(
        self, name: str, rpm: int, tpm: int, budget_usd: float, period: str, estimate_usd: float = 0.0
    ) -> Reservation | None:
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
            got = await self._script(
                self.reserve, [f"coderai:spend:{name}:{pid}", held.key], [budget_usd, estimate_usd, RESERVED_TTL_S]
            )
            if got != b"ok" and got != "ok":
                raise Limited(
                    f"{period}ly budget of ${budget_usd:g} (spent and reserved ${float(got):.4f})", end - time.time()
                )
            return held
        return None

    async def check_budget(self, name: str, budget_usd: float, period: str, estimate_usd: float) -> None:
        """Raise Limited if `estimate_usd` would pass the key's budget now (spent and reserved), reserving nothing:
        for a job accepted now and run later (a video), which reserves when it starts."""
        if not budget_usd:
            return
        pid, end = period_id(period, time.time())
        spent, reserved = await self.redis.mget(f"coderai:spend:{name}:{pid}", Reservation(name, pid, 0).key)
        used = float(spent or 0) + float(reserved or 0)
        if used + estimate_usd > budget_usd:
            raise Limited(f"{period}ly budget of ${budget_usd:g} (spent and reserved ${used:.4f})", end - time.time())

    async def refresh(self, held: Reservation) -> None:
        """Keep a running request's reservation from expiring (it would otherwise after RESERVED_TTL_S)."""
        await self.redis.expire(held.key, RESERVED_TTL_S)

    async def charge(
        self, name: str, tokens: int, tpm: int, cost_usd: float, period: str, held: Reservation | None = None
    ) -> None:
        """After a request: its tokens against `tpm`; its reservation released (in the period it was made in) and
        its real cost spent (in the period it ends in)."""
        if tpm and tokens:
            await self._gcra(f"coderai:rl:{name}:tpm", tpm, tokens, "add")
        if held is not None or cost_usd > 0:
            pid, end = period_id(period, time.time())
            reserved = held.key if held else f"coderai:reserved:{name}:{pid}"
            await self._script(
                self.settle,
                [f"coderai:spend:{name}:{pid}", reserved],
                [held.estimate_usd if held else 0, cost_usd, int(end) + 86400],
            )
