"""Revision-checked KV writes: shared state is never overwritten blindly."""

from __future__ import annotations

from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError


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
        except Exception:  # noqa: BLE001 - exists already (or expired and recreated): fall through to re-read
            pass
        try:
            entry = await self.kv.get(key)
            self.revs[key] = await self.kv.update(key, value, last=entry.revision)
        except KeyNotFoundError:
            self.revs[key] = await self.kv.create(key, value)
