"""Background jobs that outlive the gateway that started them (video jobs, batches): each record in a KV bucket
names its runner, which touches it while it works; every gateway mirrors the bucket and sweeps it, and a
record nobody touched for `after_s` is claimed by one revision-checked write (one replica wins) and resumed.

`Takeovers` is the part they share: the mirror, the sweep and its loop, the lifespan. A subclass says what its
records are (`bucket`, `record`, `what`, `live`, `due`, `claim`) and what resuming a claimed one means
(`resume`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Generic, TypeVar

import msgspec
from nats.js.errors import KeyWrongLastSequenceError

from coderai.gateway.state import Gateway
from coderai.runtime.mirror import KVMirror

log = logging.getLogger("coderai.gateway")

R = TypeVar("R", bound=msgspec.Struct)


class Takeovers(Generic[R]):
    """Enter `lifespan` after the gateway's own (the bus must be up); leaving it stops the jobs running here,
    which another replica (or this gateway, restarted) then takes over."""

    bucket: ClassVar[Any]  # the KV bucket's spec
    record: ClassVar[type]  # its records' struct
    what: ClassVar[str]  # "batch", "video job": for the logs

    def __init__(self, gw: Gateway, after_s: float) -> None:
        self.gw = gw
        self.me = f"{gw.settings.node_id or 'gateway'}:{os.getpid()}:{secrets.token_hex(3)}"
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

    async def resume(self, kv: Any, was: R, taken: R, revision: int) -> None:
        """Run a record this gateway just claimed (`taken`, at `revision`; `was` as its last runner left it)."""
        raise NotImplementedError

    async def kv(self) -> Any:
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
            except Exception as exc:  # noqa: BLE001 - the bus blinked: sweep again at the next tick
                log.warning("%s sweep failed: %s", self.what, exc)

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Any) -> AsyncIterator[None]:
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
