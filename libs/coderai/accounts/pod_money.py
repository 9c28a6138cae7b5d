"""The money side of pod escalation, all in Redis: caps, reservations, spend counters and the pod ledger.

Money is kept in Redis as integer micro-dollars (rates as micro-dollars per hour) and converted only at the edges,
so sums never drift. The pod-broker owns this state and is its only writer; the gateway (GET /admin/spend) and
metrics only read it. All of them find it under one prefix, CommonSettings' `pod_ledger_prefix`
(`CODERAI_POD_LEDGER_PREFIX`, default `coderai:pods`). Keys:

    <p>:spent:<period>:<id>      hash: "m:<model>" and "g" (global) -> micro-dollars booked in that period
    <p>:reserved:<period>:<id>   hash: same fields -> micro-dollars reserved and not yet booked or released
    <p>:res:<pod_id>             hash: model, rate, amount, until[, gpu, start]; and "<reserved key>|<field>" ->
                                 what this pod holds in that bucket, so booking releases exactly that
    <p>:rates, <p>:rate_total    running or reserved pods' hourly rates, and their sum
    <p>:booked                   set of booked pod ids (booking twice books once)
    <p>:ledger                   stream, one entry per terminated pod
    <p>:kept                     set once the journal's bookings are in this Redis (gone with an emptied Redis)

A reservation of `amount` at `rate` covers the time window [now, now + amount / rate] (an extension continues
from where the last one ended), and is cut at period boundaries: each period's share is checked against, and held
in, that period. Booking cuts the pod's [start, end] the same way for every period kind, so a pod that runs past
midnight is charged to both days in proportion, and while actual run time stays inside the reserved window no
period's spend can pass what was reserved in it. Nothing expires: counters are one hash per period id.

With a journal (`PodJournal`: the replicated `coderai_pod_ledger` bucket), each booking is written there first,
then to Redis. A Redis without the `kept` mark (emptied, or replaced by an empty one) gets every journalled booking
back (its ledger entry and its share of every period's spend) before it reserves anything, so no cap is checked
against a spend that forgot them. Reservations are not journalled: the broker reserves a running pod again when
Redis has lost its reservation.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

import msgspec

from coderai.accounts.limits import PERIODS, period_id

# KEYS: rec, rates, rate_total, booked, (spent, reserved) pairs..., kept
RESERVE = """
if redis.call('EXISTS', KEYS[#KEYS]) == 0 then return {'lost'} end
local rec, pod = KEYS[1], ARGV[2]
if redis.call('SISMEMBER', KEYS[4], pod) == 1 then return {'booked'} end
if ARGV[1] == 'new' then
  if redis.call('EXISTS', rec) == 1 then return {'exists'} end
elseif redis.call('EXISTS', rec) == 0 then return {'missing'}
elseif redis.call('HGET', rec, 'until') ~= ARGV[6] then return {'stale'} end
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
if tonumber(ARGV[5]) >= 0 and total + tonumber(ARGV[4]) > tonumber(ARGV[5]) then return {'rate', tostring(total)} end
local n = tonumber(ARGV[9])
for i = 1, n do
  local f, limit, amt = ARGV[8 + 3 * i], tonumber(ARGV[9 + 3 * i]), tonumber(ARGV[10 + 3 * i])
  if limit >= 0 then
    local used = tonumber(redis.call('HGET', KEYS[3 + 2 * i], f) or '0') + tonumber(redis.call('HGET', KEYS[4 + 2 * i], f) or '0')
    if used + amt > limit then return {'cap', tostring(i), tostring(used)} end
  end
end
-- amounts travel as the strings they came as: Lua numbers reach Redis as %.14g, which HINCRBY may refuse
for i = 1, n do
  local f, amt = ARGV[8 + 3 * i], ARGV[10 + 3 * i]
  redis.call('HINCRBY', KEYS[4 + 2 * i], f, amt)
  redis.call('HINCRBY', rec, KEYS[4 + 2 * i] .. '|' .. f, amt)
end
if ARGV[1] == 'new' then
  redis.call('HSET', rec, 'model', ARGV[8], 'rate', ARGV[3])
  redis.call('HSET', KEYS[2], pod, ARGV[3])
  redis.call('INCRBY', KEYS[3], ARGV[3])
end
redis.call('HINCRBY', rec, 'amount', ARGV[10])
redis.call('HSET', rec, 'until', ARGV[7])
return {'ok'}
"""

# KEYS: rec, rates, rate_total, booked, ledger, spent keys...; ARGV: pod, mode, model, amounts..., ledger fields...
SETTLE = """
local rec, pod = KEYS[1], ARGV[1]
if ARGV[2] == 'book' and redis.call('SADD', KEYS[4], pod) == 0 then return 0 end
local r = redis.call('HGETALL', rec)
for i = 1, #r, 2 do
  local bar = string.find(r[i], '|', 1, true)
  if bar then
    local key, f = string.sub(r[i], 1, bar - 1), string.sub(r[i], bar + 1)
    if redis.call('HINCRBY', key, f, '-' .. r[i + 1]) == 0 then redis.call('HDEL', key, f) end
  end
end
local rate = redis.call('HGET', KEYS[2], pod)
if rate then
  redis.call('HDEL', KEYS[2], pod)
  redis.call('DECRBY', KEYS[3], rate)
end
redis.call('DEL', rec)
if ARGV[2] ~= 'book' then return #r end
local n = #KEYS - 5
for i = 1, n do
  local amt = ARGV[3 + i]
  if amt ~= '0' then
    redis.call('HINCRBY', KEYS[5 + i], 'm:' .. ARGV[3], amt)
    redis.call('HINCRBY', KEYS[5 + i], 'g', amt)
  end
end
local fields = {}
for i = 4 + n, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', KEYS[5], '*', unpack(fields))
return 1
"""

OPEN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'gpu', ARGV[1], 'start', ARGV[2])
return 1
"""


class PodMoneyError(Exception):
    """Root of this module's errors."""


class ReservationError(PodMoneyError):
    """A reservation that does not exist, already exists, was booked, or changed since it was read."""


class OverBudget(PodMoneyError):
    """A cap refused a reservation. `what`: `budget` (the model's), `global_budget`, `global_hourly` (running
    pods' rates) or `max_hourly` (the model's per-pod rate); `resets_at` is None where no period resets it."""

    def __init__(self, what: str, model: str, limit_usd: float, resets_at: float | None, message: str) -> None:
        super().__init__(message)
        self.what, self.model, self.limit_usd, self.resets_at, self.message = what, model, limit_usd, resets_at, message


@dataclass(frozen=True)
class Caps:
    """Caps for one model's pods; None is no cap (0 allows nothing). Budgets are USD per period."""

    budget_usd: float | None = None
    period: str = "day"
    max_hourly_usd: float | None = None
    global_budget_usd: float | None = None
    global_period: str = "month"
    global_max_hourly_usd: float | None = None


@dataclass(frozen=True)
class Reservation:
    """What a pod holds: `amount_usd` in all, at `rate_hr`, covering run time up to `until` (unix seconds)."""

    pod_id: str
    model: str
    rate_hr: float
    amount_usd: float
    until: float


@dataclass(frozen=True)
class Pod:
    """A running pod, as `live` prices it."""

    pod_id: str
    model: str
    gpu: str
    rate_hr: float
    start: float


class Booking(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A terminated pod's bill as journalled: all that `book` writes to Redis follows from it."""

    pod_id: str
    model: str
    gpu: str
    rate_micro: int  # micro-dollars per hour
    start: float
    end: float
    booked_at: float
    usd_micro: int | None = None  # the charge itself (a serverless request's), instead of rate x (end - start)


class PodJournal:
    """Every booking in the replicated `coderai_pod_ledger` bucket, by pod id, on `bus`."""

    def __init__(self, bus: Any) -> None:
        self.bus = bus

    async def _kv(self) -> Any:
        from coderai.contracts.topology import POD_LEDGER

        return await self.bus.kv(POD_LEDGER)

    async def keep(self, b: Booking) -> Booking:
        """Journal `b`; a pod journalled before keeps its first booking, which is returned to be booked in its
        place (an end retried after a crash bills what the first one journalled, not a later end)."""
        from nats.js.errors import KeyWrongLastSequenceError

        kv = await self._kv()
        try:
            await kv.create(_pod_key(b.pod_id), msgspec.json.encode(b))
        except KeyWrongLastSequenceError:
            return msgspec.json.decode((await kv.get(_pod_key(b.pod_id))).value, type=Booking)
        return b

    async def all(self) -> list[Booking]:
        """Every booking, in the order they were booked."""
        from coderai.runtime.kv import read_all

        got = await read_all(await self._kv(), Booking)
        return sorted(got.values(), key=lambda b: (b.booked_at, b.pod_id))


def _pod_key(pod_id: str) -> str:
    """A pod id as a KV key (hex: an id may hold characters a KV key may not)."""
    return pod_id.encode().hex()


@dataclass(frozen=True)
class LedgerEntry:
    """One booked pod: `id` is its stream id (empty as `book` returns it); `usd_micro` is the exact charge."""

    id: str
    pod_id: str
    model: str
    gpu: str
    rate_hr: float
    start: float
    end: float
    seconds: float
    usd: float
    usd_micro: int


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _dec(x: float | Decimal) -> Decimal:
    return Decimal(repr(x)) if isinstance(x, float) else Decimal(x)


def to_micro(usd: float | Decimal) -> int:
    """Dollars (as written, e.g. 0.1 is exactly a tenth) to whole micro-dollars, half to even."""
    return round(Fraction(_dec(usd)) * 1_000_000)


def usd_str(micro: int) -> str:
    """Micro-dollars as an exact decimal string: 452467 -> '0.452467'."""
    return f"{Decimal(micro).scaleb(-6):f}"


def _money(micro: int) -> str:
    return f"${micro / 1e6:,.2f}" if micro % 10_000 == 0 else f"${micro / 1e6:,.6f}".rstrip("0")


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


def _cost_micro(rate_micro: int, start: float, end: float) -> int:
    return round(rate_micro * (Fraction(_dec(end)) - Fraction(_dec(start))) / 3600)


def live(pod: Any, now: float) -> float:
    """What a running pod has cost so far (boot included): its rate x (now - start), as `book` would charge."""
    return _cost_micro(to_micro(pod.rate_hr), pod.start, max(now, pod.start)) / 1e6


def _pieces(kind: str, a: Fraction, b: Fraction, total: int) -> list[tuple[str, float, int]]:
    """(period id, period end, micro-dollars) of `total` spread evenly over [a, b], cut at `kind`'s boundaries.
    Shares are rounded cumulatively, so they sum to `total` exactly."""
    out, t, done = [], a, 0
    while True:
        pid, end = period_id(kind, float(t))
        to = min(b, Fraction(end))
        cum = total if to >= b else round(total * (to - a) / (b - a))
        out.append((pid, end, cum - done))
        if to >= b:
            return out
        t, done = to, cum


class PodMoney:
    """Pod caps, reservations and billing over one Redis; a new instance over the same Redis sees the same state.
    `journal` (optional) keeps every booking beyond Redis."""

    def __init__(self, redis: Any, prefix: str = "coderai:pods", journal: PodJournal | None = None) -> None:
        if "|" in prefix:
            raise ValueError("the prefix may not contain '|'")
        self.redis, self.p, self.journal = redis, prefix, journal
        self._kept = f"{prefix}:kept"
        self._restoring = asyncio.Lock()
        self._synced = False  # this object has booked every journalled booking Redis lacked
        self._reserve = redis.register_script(RESERVE)
        self._settle = redis.register_script(SETTLE)
        self._open = redis.register_script(OPEN)

    def _rec(self, pod_id: str) -> str:
        return f"{self.p}:res:{pod_id}"

    def _base(self, pod_id: str) -> list[str]:
        return [self._rec(pod_id), f"{self.p}:rates", f"{self.p}:rate_total", f"{self.p}:booked"]

    async def reserve(
        self, model: str, pod_id: str, rate_hr: float, amount_usd: float, caps: Caps, now: float
    ) -> Reservation:
        """Check every cap and reserve `amount_usd` and `rate_hr` for a pod about to be created, atomically.
        Raises OverBudget (nothing reserved) or ReservationError (the pod id is reserved or booked already)."""
        return await self._run("new", model, pod_id, rate_hr, amount_usd, caps, now, None)

    async def extend(self, reservation: Reservation, more_usd: float, now: float, caps: Caps) -> Reservation:
        """Reserve `more_usd` for a running pod, continuing its window, under the same checks as `reserve` (its
        own rate already counts against the hourly cap). On OverBudget the broker must stop the pod.
        ReservationError if the pod was booked or released, or the reservation changed since it was read."""
        r = reservation
        return await self._run("extend", r.model, r.pod_id, r.rate_hr, more_usd, caps, max(now, r.until), r)

    async def _run(
        self,
        mode: str,
        model: str,
        pod_id: str,
        rate_hr: float,
        amount_usd: float,
        caps: Caps,
        base: float,
        old: Reservation | None,
    ) -> Reservation:
        rate, amount = to_micro(rate_hr), to_micro(amount_usd)
        if caps.max_hourly_usd is not None and rate > to_micro(caps.max_hourly_usd):
            raise OverBudget(
                "max_hourly",
                model,
                caps.max_hourly_usd,
                None,
                f"model {model!r} may not run a pod at {_money(rate)}/h: its max_hourly_usd is "
                f"{_money(to_micro(caps.max_hourly_usd))}/h",
            )
        a = Fraction(_dec(base))
        b = a + Fraction(amount * 3600, rate) if rate else a
        until = float(b)
        checks = []  # (period, id, end, field, limit or None, micro)
        for field, period, limit in (
            ("m:" + model, caps.period, caps.budget_usd),
            ("g", caps.global_period, caps.global_budget_usd),
        ):
            checks += [(period, pid, end, field, limit, m) for pid, end, m in _pieces(period, a, b, amount) if m]
        keys = self._base(pod_id)
        args: list[Any] = [
            mode,
            pod_id,
            rate,
            rate if mode == "new" else 0,
            -1 if caps.global_max_hourly_usd is None else to_micro(caps.global_max_hourly_usd),
            repr(old.until) if old else "",
            repr(until),
            model,
            len(checks),
            amount,
        ]
        for period, pid, _, field, limit, m in checks:
            keys += [f"{self.p}:spent:{period}:{pid}", f"{self.p}:reserved:{period}:{pid}"]
            args += [field, -1 if limit is None else to_micro(limit), m]
        keys.append(self._kept)
        got = [_s(x) for x in await self._reserve(keys=keys, args=args)]
        if got[0] == "lost":  # an emptied Redis: the journalled spend back before any cap is checked against it
            await self.restore()
            got = [_s(x) for x in await self._reserve(keys=keys, args=args)]
        if got[0] == "rate":
            cap = to_micro(caps.global_max_hourly_usd or 0)
            raise OverBudget(
                "global_hourly",
                model,
                caps.global_max_hourly_usd or 0.0,
                None,
                f"a pod for model {model!r} at {_money(rate)}/h would pass the global cap of "
                f"{_money(cap)}/h on running pods ({_money(int(got[1]))}/h running or reserved)",
            )
        if got[0] == "cap":
            period, _, end, field, limit, m = checks[int(got[1]) - 1]
            used = f"{_money(int(got[2]))} spent or reserved, {_money(m)} more asked"
            if field == "g":
                raise OverBudget(
                    "global_budget",
                    model,
                    limit,
                    end,
                    f"a pod for model {model!r} would pass the global {_money(to_micro(limit))} "
                    f"{period} budget ({used}); it resets at {_utc(end)}",
                )
            raise OverBudget(
                "budget",
                model,
                limit,
                end,
                f"model {model!r} has spent its {_money(to_micro(limit))} {period} budget ({used}); "
                f"it resets at {_utc(end)}",
            )
        if got[0] != "ok":
            raise ReservationError(f"pod {pod_id!r}: reservation {got[0]}")
        total = amount + (to_micro(old.amount_usd) if old else 0)
        return Reservation(pod_id, model, rate / 1e6, total / 1e6, until)

    async def _hash(self, pod_id: str) -> dict[str, str]:
        return {_s(k): _s(v) for k, v in (await self.redis.hgetall(self._rec(pod_id))).items()}

    async def reservation(self, pod_id: str) -> Reservation | None:
        """The pod's reservation as Redis holds it, or None."""
        if "model" not in (h := await self._hash(pod_id)):
            return None
        return Reservation(pod_id, h["model"], int(h["rate"]) / 1e6, int(h["amount"]) / 1e6, float(h["until"]))

    async def release(self, pod_id: str) -> bool:
        """Drop a reservation without booking (the pod was never created). False if there was none."""
        return bool(await self._settle(keys=self._base(pod_id) + [f"{self.p}:ledger"], args=[pod_id, "release"]))

    async def open_pod(self, pod_id: str, gpu: str, start: float) -> None:
        """Record that the reserved pod exists, on `gpu`, billed from `start`; `pods()` lists it."""
        if not await self._open(keys=[self._rec(pod_id)], args=[gpu, repr(float(start))]):
            raise ReservationError(f"pod {pod_id!r} has no reservation to open")

    async def pods(self) -> list[Pod]:
        """Opened pods not yet booked, by pod id (a restarted broker resumes from these)."""
        out = []
        for pod_id in sorted(_s(k) for k in await self.redis.hkeys(f"{self.p}:rates")):
            if "start" in (h := await self._hash(pod_id)):
                out.append(Pod(pod_id, h["model"], h["gpu"], int(h["rate"]) / 1e6, float(h["start"])))
        return out

    async def book(
        self,
        pod_id: str,
        model: str,
        gpu: str,
        rate_hr: float,
        start: float,
        end: float,
        now: float,
        usd: float | None = None,
    ) -> LedgerEntry | None:
        """Bill a terminated pod from `start` (creation, boot included) to `end`, atomically: one ledger entry,
        spend added to every period kind (cut at boundaries) for the model and globally, its reservation and rate
        released. Booking the same pod again does nothing and returns None. With a journal, the booking is
        journalled first (a pod journalled before is booked as it was journalled). `usd`: the charge, when it is not
        the rate x the time (a serverless request's: its seconds rounded up, plus a price per request)."""
        if end < start:
            raise ValueError(f"pod {pod_id!r} ends ({end}) before it starts ({start})")
        booking = Booking(
            pod_id=pod_id,
            model=model,
            gpu=gpu,
            rate_micro=to_micro(rate_hr),
            start=start,
            end=end,
            booked_at=now,
            usd_micro=None if usd is None else to_micro(usd),
        )
        if self.journal is not None:
            booking = await self.journal.keep(booking)
        return await self._book(booking)

    async def _book(self, bk: Booking) -> LedgerEntry | None:
        rate = bk.rate_micro
        usd = bk.usd_micro if bk.usd_micro is not None else _cost_micro(rate, bk.start, bk.end)
        a, b = Fraction(_dec(bk.start)), Fraction(_dec(bk.end))
        keys, amounts = self._base(bk.pod_id) + [f"{self.p}:ledger"], []
        for period in PERIODS:
            for pid, _, m in _pieces(period, a, b, usd):
                keys.append(f"{self.p}:spent:{period}:{pid}")
                amounts.append(m)
        seconds = _dec(bk.end) - _dec(bk.start)
        fields = {
            "pod_id": bk.pod_id,
            "model": bk.model,
            "gpu": bk.gpu,
            "rate": usd_str(rate),
            "start": repr(float(bk.start)),
            "end": repr(float(bk.end)),
            "seconds": f"{seconds:f}",
            "usd": usd_str(usd),
            "booked_at": repr(bk.booked_at),
        }
        flat = [x for kv in fields.items() for x in kv]
        if not await self._settle(keys=keys, args=[bk.pod_id, "book", bk.model, *amounts, *flat]):
            return None
        return LedgerEntry(
            "", bk.pod_id, bk.model, bk.gpu, rate / 1e6, bk.start, bk.end, float(seconds), usd / 1e6, usd
        )

    async def restore(self) -> int:
        """Book into Redis every journalled booking it lacks, then mark it as holding them: on this object's first
        call (a broker that died between the journal and Redis books the rest now) and whenever the mark is gone
        (Redis emptied or replaced); otherwise one EXISTS. Booking is by pod id, so none is booked twice. Returns
        how many were booked."""
        async with self._restoring:
            if self._synced and await self.redis.exists(self._kept):
                return 0
            booked = 0
            for bk in await self.journal.all() if self.journal is not None else []:
                booked += await self._book(bk) is not None
            await self.redis.set(self._kept, "1")
            self._synced = True
            return booked

    async def _read(self, kind: str, model: str | None, period: str, now: float) -> float:
        pid, _ = period_id(period, now)
        v = await self.redis.hget(f"{self.p}:{kind}:{period}:{pid}", "g" if model is None else "m:" + model)
        return int(v or 0) / 1e6

    async def spend(self, model: str | None = None, period: str = "day", now: float | None = None) -> float:
        """USD booked in the `period` holding `now` (default: the clock), for `model` or (None) all pods."""
        return await self._read("spent", model, period, time.time() if now is None else now)

    async def reserved(self, model: str | None = None, period: str = "day", now: float | None = None) -> float:
        """USD reserved and not yet booked or released in the `period` holding `now`, as `spend`."""
        return await self._read("reserved", model, period, time.time() if now is None else now)

    async def running_rate(self) -> float:
        """USD per hour of every pod running or reserved."""
        return int(await self.redis.get(f"{self.p}:rate_total") or 0) / 1e6

    async def ledger(self, since: str | None = None, count: int = 1000) -> list[LedgerEntry]:
        """Up to `count` ledger entries after stream id `since` (None: from the first), oldest first."""
        rows = await self.redis.xrange(f"{self.p}:ledger", min="-" if since is None else f"({since}", count=count)
        out = []
        for rid, raw in rows:
            f = {_s(k): _s(v) for k, v in raw.items()}
            usd = to_micro(Decimal(f["usd"]))
            out.append(
                LedgerEntry(
                    _s(rid),
                    f["pod_id"],
                    f["model"],
                    f["gpu"],
                    float(f["rate"]),
                    float(f["start"]),
                    float(f["end"]),
                    float(f["seconds"]),
                    usd / 1e6,
                    usd,
                )
            )
        return out

    async def ledger_total_usd(self) -> float:
        """The sum of every ledger entry, added in whole micro-dollars."""
        total, since = 0, None
        while batch := await self.ledger(since):
            total += sum(e.usd_micro for e in batch)
            since = batch[-1].id
        return total / 1e6
