"""Background jobs that outlive the gateway that started them (video jobs, batches; background responses use the
`Tenure` and `keepalive` below, and are failed, not resumed, when their gateway stops): each record in a KV bucket
names its runner, which touches it while it works; every gateway mirrors the bucket and sweeps it, and a
record nobody touched for `after_s` is claimed by one revision-checked write (one replica wins) and resumed.

What they share lives here:
- `Takeovers`: the mirror, the sweep and its loop, the lifespan. A subclass says what its records are (`bucket`,
  `record`, `what`, `live`, `due`, `claim`) and what resuming a claimed one means (`resume`).
- `Tenure`: the runner's hold on one record. Each write names the revision it replaces, so a runner that was only
  slow (taken for dead, its job claimed) learns at its next write that the job moved on (`Superseded`) instead of
  racing the new runner. A subclass says what losing a write race to another change means (`lost`).
- `keepalive`: the loop that touches the record while the work runs, and stops the work when superseded.
- `caller_for`: the caller a taken-over job runs as.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import ClassVar, Generic, Protocol, TypeVar, cast

import msgspec
from litestar import Litestar
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from coderai.contracts.topology import BucketSpec
from coderai.gateway.auth import Authenticator, Caller
from coderai.gateway.state import Gateway
from coderai.runtime.mirror import KVMirror

log = logging.getLogger("coderai.gateway")


class Record(Protocol):
    """What this module reads of a record (a msgspec Struct: `VideoRecord`, `BatchRecord`, `StoredResponse`)."""

    @property
    def id(self) -> str: ...

    @property
    def runner(self) -> str: ...

    @property
    def updated_at(self) -> float: ...


R = TypeVar("R", bound=Record)


def replace(rec: R, **changes: object) -> R:
    """`msgspec.structs.replace` for a record: a record is a Struct with `Record`'s fields, which no one type says
    (a Protocol cannot also be a Struct), so it goes through as the Struct it is."""
    return cast(R, msgspec.structs.replace(cast(msgspec.Struct, rec), **changes))


RACES = 5  # write races a runner loses in a row before it takes the record for lost


class Superseded(Exception):
    """Another gateway runs this record's job now: stop working on it and write nothing more."""


class Tenure(Generic[R]):
    """One gateway's hold on one record (`rec`, at `revision`): each write names the revision it replaces. The
    keep-alive and the job's own writes never interleave (`lock`)."""

    record: type[R]  # the records' struct, to read them back (set on the subclass)

    def __init__(self, kv: KeyValue, rec: R, revision: int) -> None:
        self.kv, self.rec, self.revision = kv, rec, revision
        self.lock = asyncio.Lock()

    def lost(self, current: R, changes: dict[str, object]) -> dict[str, object]:
        """A write lost its race to `current` (still this runner's record): the changes to try again on it, or
        `Superseded` when that change means the job is no longer this runner's to write. By default the other
        change is kept and the write goes on."""
        return changes

    async def save(self, **changes: object) -> None:
        """Change the record (and `updated_at`) and write it; `Superseded` when another runner holds it now."""
        async with self.lock:
            for _ in range(RACES):
                rec = replace(self.rec, **changes, updated_at=time.time())
                try:
                    self.revision = await self.kv.update(rec.id, msgspec.json.encode(rec), last=self.revision)
                    self.rec = rec
                    return
                except KeyWrongLastSequenceError:
                    changes = await self.reread(changes)
            raise Superseded(f"{self.rec.id}: lost {RACES} write races in a row")

    async def reread(self, changes: dict[str, object]) -> dict[str, object]:
        """Take the record as it is now (when `lost` accepts the change that made it so); the lock is held."""
        entry = await self.kv.get(self.rec.id)
        assert entry.value is not None and entry.revision is not None  # `get` of a live key has both
        current = msgspec.json.decode(entry.value, type=self.record)
        if current.runner != self.rec.runner:
            raise Superseded(f"{self.rec.id} is now run by {current.runner or 'another gateway'}")
        changes = self.lost(current, changes)
        self.rec, self.revision = current, entry.revision
        return changes


async def keepalive(
    tenure: Tenure[R],
    work: asyncio.Task,
    every_s: float,
    what: str,
    tick: Callable[[], Awaitable[bool]] | None = None,
) -> None:
    """Touch `tenure`'s record every `every_s` while `work` runs (unless the work's own writes kept it fresh), so
    that no replica takes live work for abandoned. `tick`, asked at each turn first, says whether to stop the work
    (a revoked key), or reads news (a cancel). Superseded, or stopped by `tick`: `work` is cancelled and the loop
    ends. Any other failure (the bus blinked) is tried again at the next turn."""
    while True:
        await asyncio.sleep(every_s)
        try:
            if tick is not None and await tick():
                work.cancel()
                return
            if time.time() - tenure.rec.updated_at >= every_s:
                await tenure.save()
        except Superseded as exc:
            log.warning("%s %s: %s; stopping here", what, tenure.rec.id, exc)
            work.cancel()
            return
        except Exception as exc:  # the bus blinked: try again at the next tick
            log.warning("%s %s: could not touch its record (%s)", what, tenure.rec.id, exc)


def runner_id(node_id: str) -> str:
    """The name a gateway process writes into the records it runs: its node, its pid and a random tail (a process
    started again under the same pid is another runner)."""
    return f"{node_id or 'gateway'}:{os.getpid()}:{secrets.token_hex(3)}"


async def caller_for(auth: Authenticator, key_name: str) -> Caller:
    """The caller a taken-over job runs as: the Redis key of that name (its limits and budget are charged), or,
    for a key from the keys file (or auth off), a caller of that name with no Redis key, as when it was accepted."""
    store = auth.store
    if store is not None and key_name:
        key = await store.by_name(key_name)
        if key is not None:
            return Caller(key.name, frozenset(key.scopes), key)
    return Caller(key_name or "anonymous", frozenset({"inference"}))


class Takeovers(Generic[R]):
    """Enter `lifespan` after the gateway's own (the bus must be up); leaving it stops the jobs running here,
    which another replica (or this gateway, restarted) then takes over."""

    bucket: ClassVar[BucketSpec]  # the KV bucket's spec
    record: type[R]  # its records' struct (set on the subclass)
    what: ClassVar[str]  # "batch", "video job": for the logs

    def __init__(self, gw: Gateway, after_s: float) -> None:
        self.gw = gw
        self.me = runner_id(gw.settings.node_id)
        self.after_s = after_s
        self.touch_every_s = min(5.0, after_s / 4)  # a live runner is never mistaken for a dead one
        self.running: dict[str, asyncio.Task] = {}  # record id -> the task running it here
        self.mirror: KVMirror[R] | None = None
        self.seen: dict[str, float] = {}  # record id -> when this gateway last saw it change (monotonic)

    # what a subclass says of its records
    def live(self, rec: R) -> bool:
        raise NotImplementedError

    def due(self, rec: R, quiet_s: float) -> bool:
        raise NotImplementedError

    def claim(self, rec: R) -> R:
        raise NotImplementedError

    async def resume(self, kv: KeyValue, was: R, taken: R, revision: int) -> None:
        """Run a record this gateway just claimed (`taken`, at `revision`; `was` as its last runner left it)."""
        raise NotImplementedError

    async def kv(self) -> KeyValue:
        raise NotImplementedError

    def track(self, rec_id: str, task: asyncio.Task) -> None:
        self.running[rec_id] = task
        task.add_done_callback(lambda _: self.running.pop(rec_id, None))

    async def sweep(self) -> None:
        """Claim every record due for takeover and resume it."""
        assert self.mirror is not None
        kv = await self.kv()
        for key, rec in list(self.mirror.values.items()):
            if key in self.running or not self.due(rec, time.monotonic() - self.seen.get(key, time.monotonic())):
                continue
            taken = self.claim(rec)
            try:
                revision = await kv.update(key, msgspec.json.encode(taken), last=self.mirror.revisions[key])
            except KeyWrongLastSequenceError:
                continue  # its runner wrote, or another replica claimed it first
            self.mirror.remember(key, taken, revision)
            self.seen[key] = time.monotonic()
            await self.resume(kv, rec, taken, revision)

    async def sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.touch_every_s)
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the bus blinked: sweep again at the next tick
                log.warning("%s sweep failed: %s", self.what, exc)

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Litestar) -> AsyncIterator[None]:
        def changed(key: str, rec: R | None) -> None:
            if rec is None or not self.live(rec):
                self.seen.pop(key, None)
            else:
                self.seen[key] = time.monotonic()

        self.mirror = KVMirror(self.gw.bus, self.bucket, self.record, on_change=changed)
        self.mirror.start()
        self.gw.reconnect_hooks.append(self.mirror.start)  # a restarted server may have dropped the watch
        sweeper = asyncio.create_task(self.sweeper())
        try:
            yield
        finally:
            sweeper.cancel()
            self.mirror.stop()
            tasks = list(self.running.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(sweeper, *tasks, return_exceptions=True)
