"""KV helpers: revision-checked writes (shared state is never overwritten blindly), and reading a whole bucket."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from coderai.contracts import decode

log = logging.getLogger("coderai.kv")

T = TypeVar("T")


async def replay(watcher: Any) -> AsyncIterator[Any]:
    """The entries of a nats-py KV watch's initial replay, then stop. Not up to nats-py's end-of-replay marker
    alone: it can come before the replay's last entries (a message still in flight when the watch was set up, or
    one whose pending count read 0 too soon: nats-io/nats.py#842), and a reader that stopped there missed keys (a
    finished batch read none of its three answers; a mirror called whole lacked a model). The replay is over when
    as many entries came as the watch's consumer had to deliver when it was made, or, when some of those are not
    handed on (deletes, with `ignore_deletes`), when nothing came for a second and the server has nothing pending."""
    import nats.errors

    sub = watcher._sub  # nats-py's watcher: its ordered consumer
    info = await sub.consumer_info()
    initial, seen = info.delivered.consumer_seq + info.num_pending, 0
    while seen < initial:
        try:
            entry = await watcher.updates(timeout=1.0)
        except nats.errors.TimeoutError:
            if (await sub.consumer_info()).num_pending == 0:
                return
            continue
        if entry is not None:
            seen += 1
            yield entry


async def _subjects(kv: Any) -> list[str]:
    """Every key the bucket's stream holds a message for (a value, or the marker of a delete or purge), from the
    stream's own subject listing, page by page. nats-py's `keys()` reads them through a watcher instead, whose
    initial replay can end early: a listing came back short, or empty as NoKeysError, with the keys there
    (nats-io/nats.py#842; CI read a bucket of placements as empty, a test of three keys saw fewer)."""
    js, pre = kv._js, kv._pre  # nats-py's KeyValue: its JetStream context and "$KV.<bucket>."
    keys: list[str] = []
    while True:
        req = msgspec.json.encode({"subjects_filter": pre + ">", "offset": len(keys)})
        resp = await js._api_request(f"{js._prefix}.STREAM.INFO.{kv._stream}", req, timeout=js._timeout)
        page = (resp.get("state") or {}).get("subjects") or {}
        keys.extend(subject[len(pre) :] for subject in page)
        if not page or len(keys) >= int(resp.get("total") or 0):
            return keys


async def _entries(kv: Any, prefix: str) -> dict[str, Any]:
    """The current entry of each key (starting with `prefix`) that holds a value (a deleted or purged one is left
    out), read 64 at a time."""
    keys = [k for k in await _subjects(kv) if k.startswith(prefix)]

    async def one(key: str) -> Any:
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:  # deleted or purged (nats-py turns KeyDeletedError into this), or expired
            return None
        return entry if entry.value else None

    out: dict[str, Any] = {}
    for i in range(0, len(keys), 64):
        chunk = keys[i : i + 64]
        for key, entry in zip(chunk, await asyncio.gather(*(one(k) for k in chunk))):
            if entry is not None:
                out[key] = entry
    return out


async def list_keys(kv: Any, *, prefix: str = "") -> list[str]:
    """The keys of a bucket (those starting with `prefix`) that hold a value; [] for an empty bucket."""
    return list(await _entries(kv, prefix))


async def read_all(kv: Any, type_: type[T] | Any, *, prefix: str = "") -> dict[str, T]:
    """Every key of a bucket (starting with `prefix`) with its value decoded into `type_`. A key deleted between
    listing and reading is left out, and so is a value that does not decode (logged at debug)."""
    out: dict[str, T] = {}
    for key, entry in (await _entries(kv, prefix)).items():
        try:
            out[key] = decode(entry.value, type_)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.debug("skipping %s: not a %s: %s", key, getattr(type_, "__name__", type_), exc)
    return out


async def read_key(kv: Any, key: str, type_: type[T] | Any) -> T | None:
    """The value of `key` decoded into `type_`; None when it is missing, deleted or does not decode."""
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return None
    if not entry.value:
        return None
    try:
        return decode(entry.value, type_)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


async def put_if_changed(kv: Any, key: str, value: bytes, attempts: int = 5) -> bool:
    """Write `value` unless it is already there; each write names the revision it replaces.

    A concurrent writer makes the check fail; we re-read and try again. Returns True if we wrote.
    """
    for _ in range(attempts):
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            entry = None
        try:
            if entry is None or entry.value is None or entry.operation in ("DEL", "PURGE"):
                if entry is None:
                    await kv.create(key, value)
                else:
                    await kv.update(key, value, last=entry.revision)
                return True
            if entry.value == value:
                return False
            await kv.update(key, value, last=entry.revision)
            return True
        except KeyWrongLastSequenceError:
            continue
    raise KeyWrongLastSequenceError(description=f"{key}: lost {attempts} races in a row")


class RevisionCache:
    """For a single writer refreshing its own keys often (heartbeat records): remember the last revision
    written so each refresh is one round trip, falling back to a re-read when someone else wrote."""

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        self.revs: dict[str, int] = {}

    async def put(self, key: str, value: bytes) -> None:
        rev = self.revs.get(key)
        if rev is not None:
            try:
                self.revs[key] = await self.kv.update(key, value, last=rev)
                return
            except KeyWrongLastSequenceError:
                pass
        try:
            self.revs[key] = await self.kv.create(key, value)
            return
        except Exception:  # exists already (or expired and recreated): fall through to re-read
            pass
        try:
            entry = await self.kv.get(key)
            self.revs[key] = await self.kv.update(key, value, last=entry.revision)
        except KeyNotFoundError:
            self.revs[key] = await self.kv.create(key, value)


class KeyWatch:
    """The values of one key of a KV bucket, in order: the current one first, then each change (b"" for a delete).

    A named push consumer filtered to that key delivers them, so the rights a reader needs name the key itself
    (a node may read only its own assignment: runtime/members.py). The server's idle heartbeats show the
    consumer is alive; `next()` raises TimeoutError when they stop (the caller starts a new watch)."""

    HEARTBEAT_S = 5.0

    def __init__(self, bus: Any, bucket: str, key: str) -> None:
        self.bus, self.stream, self.subject = bus, f"KV_{bucket}", f"$KV.{bucket}.{key}"
        self.name = ""
        self._sub: Any = None

    async def start(self) -> "KeyWatch":
        import secrets

        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        inbox = self.bus.nc.new_inbox()
        self._sub = await self.bus.nc.subscribe(inbox)
        self.name = "watch-" + secrets.token_hex(8)
        cfg = ConsumerConfig(
            name=self.name,
            filter_subject=self.subject,
            deliver_subject=inbox,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=AckPolicy.NONE,
            idle_heartbeat=self.HEARTBEAT_S,
            inactive_threshold=60.0,
            mem_storage=True,
        )
        await self.bus.js.add_consumer(self.stream, cfg)
        return self

    async def next(self) -> bytes:
        while True:
            msg = await self._sub.next_msg(timeout=self.HEARTBEAT_S * 3)
            headers = msg.headers or {}
            if headers.get("Status") == "100":  # an idle heartbeat (or flow control): alive, nothing new
                continue
            if headers.get("KV-Operation") in ("DEL", "PURGE"):
                return b""
            return msg.data

    async def stop(self) -> None:
        import contextlib

        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        if self.name:
            with contextlib.suppress(Exception):
                await self.bus.js.delete_consumer(self.stream, self.name)
