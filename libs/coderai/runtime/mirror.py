"""A local mirror of a KV bucket, kept current by a watch: reads cost a dict lookup, not a bus round trip."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

import msgspec

from coderai.contracts import decode, why_malformed
from coderai.contracts.topology import BucketSpec
from coderai.runtime.bus import Bus
from coderai.runtime.kv import replay

log = logging.getLogger("coderai.mirror")

T = TypeVar("T")


class KVMirror(Generic[T]):
    """`values[key]` and `revisions[key]` for every live key of one bucket.

    The watch replays the bucket first (so a restarted service starts with the shared state), then follows
    changes. Call `start()` again after a reconnect: a restarted server may have dropped the watch's consumer.

    `synced` is set once the first whole read is done. `current` is set while the mirror is whole and following
    the bucket: it is cleared while a watch (re)starts or catches up (after a reconnect, a failover of the bucket's
    stream, a bucket made anew), so a reader can tell "this key is absent" (current) from "my view is being
    rebuilt" (not current: wait for `current`, or say so).

    `max_entries` bounds a bucket that is a cache (affinity): past it, the keys written longest ago are dropped
    from memory (not from the bucket), a sixteenth at a time. `values` is kept in write order for that: a key
    written again moves to the end. `shrink` maps each decoded value before it is kept (to share repeated
    strings, say).
    """

    def __init__(
        self,
        bus: Bus,
        spec: BucketSpec,
        type_: type[T],
        on_change: Callable[[str, T | None], None] | None = None,
        *,
        max_entries: int = 0,
        shrink: Callable[[T], T] | None = None,
    ) -> None:
        self.bus = bus
        self.spec = spec
        self.type = type_
        self.values: dict[str, T] = {}
        self.revisions: dict[str, int] = {}
        self.max_entries = max_entries
        self.evicted = 0  # keys dropped for the bound, since start
        self.last_seq = 0  # the newest revision seen: a restarted watch goes on from there
        self._created: Any = None  # when the bucket's stream was made, as the first full read saw it
        self._shrink = shrink
        self.synced = asyncio.Event()
        self.current = asyncio.Event()
        self.kv: Any = None
        self._on_change = on_change
        self._task: asyncio.Task | None = None

    async def bind(self) -> Any:
        self.kv = await self.bus.kv(self.spec)
        return self.kv

    def start(self) -> None:
        self.current.clear()
        if self._task is not None:
            self._task.cancel()
        self._task = asyncio.create_task(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def put(self, key: str, value: T) -> None:
        """Keep `value` under `key` (newest in write order), dropping the oldest keys past `max_entries`."""
        self.values.pop(key, None)
        self.values[key] = value
        if self.max_entries and len(self.values) > self.max_entries + max(1, self.max_entries // 16):
            extra = len(self.values) - self.max_entries
            for old in list(itertools.islice(self.values, extra)):
                self.forget(old)
            self.evicted += extra

    def remember(self, key: str, value: T, revision: int) -> None:
        """Record our own write at once, before the watch echoes it back."""
        if revision >= self.revisions.get(key, 0):
            self.put(key, value)
            self.revisions[key] = revision

    def forget(self, key: str) -> None:
        self.values.pop(key, None)
        self.revisions.pop(key, None)

    async def _watch(self) -> None:
        while True:
            watcher = None
            try:
                kv = self.kv or await self.bind()
                if self.last_seq and await self._resumable(kv):
                    await self._follow_from(kv, self.last_seq + 1)
                    continue
                self._created = (await self.bus.js.stream_info(kv._stream)).created
                watcher = await kv.watch(">")
                await self._replay(watcher)
                while True:
                    entry = await watcher.updates(timeout=None)
                    if entry is not None:
                        self._apply(entry)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # restarted; the mirror keeps serving what it has
                self.current.clear()
                log.warning("watch of %s ended (%s); restarting", self.spec.name, exc)
                await asyncio.sleep(0.5)
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()

    async def _replay(self, watcher: Any) -> None:
        """Apply the watch's replay of the bucket, then say the mirror is whole: once the replay is really over
        (`kv.replay`), not at nats-py's end marker, which can come first (a model then read as absent)."""
        async for entry in replay(watcher):
            self._apply(entry)
        self.synced.set()
        self.current.set()

    async def _resumable(self, kv: Any) -> bool:
        """Whether the bucket's stream is still the one this mirror read (a server whose store was wiped makes it
        anew and starts its sequences again: then the whole bucket is read again, from nothing)."""
        info = await self.bus.js.stream_info(kv._stream)
        if info.state.last_seq >= self.last_seq and info.created == self._created:
            return True
        log.warning("%s starts again below revision %d: reading it whole", self.spec.name, self.last_seq)
        gone = list(self.values)
        self.values.clear()
        self.revisions.clear()
        self.last_seq = 0
        if self._on_change:  # what was read before is no longer known to exist (`current` is clear meanwhile)
            for key in gone:
                self._on_change(key, None)
        return False

    async def _follow_from(self, kv: Any, start_seq: int) -> None:
        """The changes from `start_seq` on: after a reconnect only what changed while away, not the whole bucket
        again (a bucket of 50,000 affinity keys, read whole after every NATS restart, raised the router's resident
        memory by its peak each time)."""
        from nats.js.api import ConsumerConfig, DeliverPolicy

        queue: asyncio.Queue = asyncio.Queue()

        async def arrived(msg: Any) -> None:
            queue.put_nowait(msg)

        sub = await self.bus.js.subscribe(
            f"{kv._pre}>",
            stream=kv._stream,
            cb=arrived,
            ordered_consumer=True,
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq, inactive_threshold=300
            ),
        )
        self.synced.set()
        try:
            if queue.empty() and (await sub.consumer_info()).num_pending == 0:
                self.current.set()  # nothing changed while away
            while True:
                msg = await queue.get()
                headers = msg.headers or {}
                op = headers.get("KV-Operation") or ("PURGE" if "Nats-Marker-Reason" in headers else None)
                self._apply(_Change(msg.subject[len(kv._pre) :], msg.data, msg.metadata.sequence.stream, op))
                if msg.metadata.num_pending == 0:  # caught up with what changed while away
                    self.current.set()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _apply(self, entry: Any) -> None:
        self.last_seq = max(self.last_seq, entry.revision)
        if entry.revision < self.revisions.get(entry.key, 0):
            return
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            self.forget(entry.key)
            value = None
        else:
            try:
                value = decode(entry.value, self.type)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                log.error("bad value under %s/%s: %s", self.spec.name, entry.key, why_malformed(exc))
                return
            if self._shrink is not None:
                value = self._shrink(value)
            self.put(entry.key, value)
            self.revisions[entry.key] = entry.revision
        if self._on_change:
            self._on_change(entry.key, value)


class _Change(NamedTuple):
    """One change read from the bucket's stream, shaped as nats-py's watch entries are."""

    key: str
    value: bytes
    revision: int
    operation: str | None
