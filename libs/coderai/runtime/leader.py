"""One leader per singleton: a lease in the `coderai_leaders` bucket, won by create-if-absent, kept by
revision-checked renewals, lost when they stop (the bucket's TTL drops the record).

Every head runs the scheduler, the pod broker, ...; each asks for its role's lease and acts only while `held`.
The lease's fencing token (the revision of the write that won it) goes with what the leader writes, and the
reader refuses a token older than the newest it has seen: a leader that stalled (a pause, a partition) and wakes
up after another took over cannot undo the new leader's work.

A holder stops acting before its lease can lapse at the server: `held` turns false `TTL * 3/4` after the last
renewal that was *sent*, and the server only drops the record a whole TTL after it *stored* it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from coderai.contracts import decode, encode
from coderai.contracts.leaders import SINGLETONS, LeaderInfo, LeaderRecord
from coderai.contracts.topology import LEADER_TTL_S, LEADERS, BucketSpec
from coderai.runtime.bus import Bus
from coderai.runtime.lifecycle import Starter, stop_task
from coderai.runtime.node_id import stable_node_id
from coderai.runtime.settings import CommonSettings

log = logging.getLogger("coderai.leader")


class Leader:
    """The lease of `role` for `holder` (a head's id). Run `run()` as a task; read `held` and `token` before
    acting; `on_change(held)` (a function or a coroutine function) is called when leadership is won or lost."""

    def __init__(
        self,
        bus: Bus,
        role: str,
        holder: str,
        *,
        spec: BucketSpec = LEADERS,
        on_change: Callable[[bool], Any] | None = None,
    ) -> None:
        self.bus = bus
        self.role = role
        self.holder = holder
        self.spec = spec
        self.ttl_s = spec.ttl_s or LEADER_TTL_S
        self.renew_s = self.ttl_s / 4
        self.token = 0  # while held: the fencing token
        self.leader = ""  # who holds it, as last read ("" unknown or nobody)
        self.won = 0  # times this process won it
        self.on_change = on_change
        self._rev = 0
        self._since = 0.0
        self._valid_until = 0.0  # monotonic
        self._notified = False
        self._task: asyncio.Task | None = None

    @property
    def held(self) -> bool:
        return self.token > 0 and time.monotonic() < self._valid_until

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=f"leader:{self.role}")

    async def try_once(self) -> bool:
        """One attempt to win, now (before `start`): a lone head leads from its first second."""
        with contextlib.suppress(Exception):
            await self._try_win(await self.bus.kv(self.spec), time.monotonic())
        return self.held

    async def stop(self) -> None:
        """Step down: the record is deleted (revision-checked), so another head takes over at once, not a TTL on."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.held:
            with contextlib.suppress(Exception):
                kv = await self.bus.kv(self.spec)
                await asyncio.wait_for(kv.delete(self.role, last=self._rev), 2)
                log.info("%s: %s stepped down", self.role, self.holder)
        self.token = 0
        await self._notify()

    async def run(self) -> None:
        await self._notify()
        while True:
            sent = time.monotonic()
            try:
                # bounded by one round: a write sent while the bucket's stream elects a new leader (its last one on a
                # dead head) gets no answer, and waiting out the client's 5 s would push the next try that far; and a
                # holder's by what is left of its lease, so a renewal that hangs (cut off) never keeps it acting
                # past the moment it must stop
                limit = self.renew_s
                if self.held:
                    limit = max(0.01, min(limit, self._valid_until - time.monotonic()))
                deadline = time.monotonic() + limit
                kv = await asyncio.wait_for(self.bus.kv(self.spec), limit)
                await asyncio.wait_for(
                    self._renew(kv, sent) if self.token else self._try_win(kv, sent),
                    max(0.01, deadline - time.monotonic()),
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the bus is down or slow: `held` lapses by itself if it lasts
                log.debug("%s lease: %s", self.role, exc)
            if self.token and not self.held:
                log.warning("%s: %s lost the lease (no renewal for %.1f s)", self.role, self.holder, self.ttl_s * 0.75)
                self.token = 0
            await self._notify()
            wait = self.renew_s
            if self.held:
                wait = min(wait, max(0.0, self._valid_until - time.monotonic()))
            await asyncio.sleep(wait)

    async def _try_win(self, kv: KeyValue, sent: float) -> None:
        now = time.time()
        try:
            rev = await kv.create(self.role, encode(LeaderRecord(holder=self.holder, since=now, renewed=now)))
        except KeyWrongLastSequenceError:
            entry = await kv.get(self.role)
            theirs = _record(entry)
            self.leader = theirs.holder if theirs else ""
            if theirs is None or theirs.holder != self.holder:
                return
            # our own record, from before this process restarted on this head: take it over with a new token
            rev = await kv.update(
                self.role, encode(LeaderRecord(holder=self.holder, since=now, renewed=now)), last=entry.revision
            )
        self.token = self._rev = rev
        self._since = now
        self._valid_until = sent + self.ttl_s * 0.75
        self.leader = self.holder
        self.won += 1
        log.info("%s: %s is the leader (token %d)", self.role, self.holder, rev)

    async def _renew(self, kv: KeyValue, sent: float) -> None:
        record = LeaderRecord(holder=self.holder, token=self.token, since=self._since, renewed=time.time())
        try:
            self._rev = await kv.update(self.role, encode(record), last=self._rev)
        except (KeyWrongLastSequenceError, KeyNotFoundError):
            entry = None
            with contextlib.suppress(KeyNotFoundError):
                entry = await kv.get(self.role)
            mine = _record(entry)
            if (
                entry is None
                or mine is None
                or mine.holder != self.holder
                or (mine.token or entry.revision) != self.token
            ):
                self.leader = mine.holder if mine else ""
                log.warning(
                    "%s: %s lost the lease (%s)",
                    self.role,
                    self.holder,
                    f"{self.leader} took it" if self.leader else "it lapsed",
                )
                self.token = 0
                return
            # our last renewal was stored but its reply was lost: renew on top of it
            self._rev = await kv.update(self.role, encode(record), last=entry.revision)
        self._valid_until = sent + self.ttl_s * 0.75

    async def _notify(self) -> None:
        held = self.held
        if held == self._notified:
            return
        self._notified = held
        if self.on_change is not None:
            result = self.on_change(held)
            if inspect.isawaitable(result):
                await result


def _record(entry: KeyValue.Entry | None) -> LeaderRecord | None:
    if entry is None or not entry.value or entry.operation in ("DEL", "PURGE"):
        return None
    try:
        return decode(entry.value, LeaderRecord)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


async def leaders(kv: KeyValue, roles: tuple[str, ...] = SINGLETONS) -> list[LeaderInfo]:
    """Who holds each of `roles` now, read from the `coderai_leaders` bucket `kv` (for `/admin/cluster`,
    `coderai status` and the metric)."""
    out = []
    for role in roles:
        try:
            entry = await kv.get(role)
        except KeyNotFoundError:
            entry = None
        rec = _record(entry)
        if rec is None or entry is None:
            out.append(LeaderInfo(role=role))
            continue
        out.append(
            LeaderInfo(
                role=role,
                holder=rec.holder,
                token=rec.token or entry.revision or 0,
                since=rec.since,
                age_s=round(max(0.0, time.time() - rec.renewed), 3),
            )
        )
    return out


class Fence:
    """The reader's side: the newest token seen; a command with an older one is refused. Token 0 means a writer
    outside any lease (a test, a tool) and is let through."""

    def __init__(self) -> None:
        self.newest = 0

    def admits(self, token: int) -> bool:
        if token and token < self.newest:
            return False
        self.newest = max(self.newest, token)
        return True


def singleton(
    role: str, settings: CommonSettings, make_start: Callable[[Leader], Starter], holder: str = ""
) -> Starter:
    """A service `make_start(leader)` makes, run only while this process holds `role`'s lease.

    Every head runs it; one leads. The others wait as standbys. A leader that loses the lease stops the service
    (its subscriptions, loops and connections, as on a signal) and waits as a standby again. Once it wins again, it
    starts a fresh one, so nothing half-led stays behind. `holder` defaults to this head's node id: a process
    restarted on the same head takes its own lease back at once, without waiting out the TTL.
    """

    async def start(stack: contextlib.AsyncExitStack, stop: asyncio.Event) -> None:
        bus = await Bus.connect_as(settings, f"{role}-lease")
        stack.push_async_callback(bus.close)
        changed = asyncio.Event()
        leader = Leader(
            bus,
            role,
            holder or stable_node_id(settings.data_dir, settings.node_id),
            on_change=lambda _held: changed.set(),
        )
        inner: list[contextlib.AsyncExitStack] = []

        async def lead() -> None:
            inner.append(contextlib.AsyncExitStack())
            try:
                await make_start(leader)(inner[0], stop)
            except BaseException:
                await _close(inner)
                raise
            log.info("%s: leading on %s (token %d)", role, leader.holder, leader.token)

        async def follow() -> None:
            try:
                while True:
                    await changed.wait()
                    changed.clear()
                    if leader.held and not inner:
                        try:
                            await lead()
                        except Exception as exc:  # tried again on the next change (or renewal)
                            log.warning("%s: starting as the leader failed (%s); trying again", role, exc)
                            await asyncio.sleep(1.0)
                            changed.set()
                    elif not leader.held and inner:
                        log.warning("%s: lost the lease; stopped until this head leads again", role)
                        await _close(inner)
            finally:
                await _close(inner)

        if await leader.try_once():
            await lead()
        else:
            log.info("%s: standby (%s leads)", role, leader.leader or "nobody yet")
        leader.start()
        stack.push_async_callback(leader.stop)  # after the service below has stopped: a step-down hands over
        task = asyncio.create_task(follow(), name=f"follow:{role}")
        stack.push_async_callback(stop_task, task)

    return start


async def _close(inner: list[contextlib.AsyncExitStack]) -> None:
    while inner:
        try:
            await asyncio.wait_for(inner.pop().aclose(), 15)
        except asyncio.TimeoutError:
            log.warning("stopping the service took longer than 15 s; going on")
