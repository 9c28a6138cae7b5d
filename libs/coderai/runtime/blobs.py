"""Bytes on the bus: small ones ride inline in a message, large ones go to the `coderai_blobs` object store.

NATS keeps its default 1 MB max payload, so a message never carries more than `INLINE_MAX` bytes of blobs in
all; the rest are stored under random names (unguessable, so the gateway may serve them as image URLs) and
expire after the bucket's TTL.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, TypeVar

import msgspec

from coderai.contracts.media import Blob
from coderai.contracts.topology import BLOBS

log = logging.getLogger("coderai.blobs")

INLINE_MAX = 192 * 1024
"""Bytes of blobs one message may carry inline, all blobs together."""

M = TypeVar("M")


class BlobMissing(Exception):
    """A blob's stored object is gone (expired, or never written)."""


class BlobStore:
    """Packs and unpacks `Blob`s; binds the object store on first use (created when `create` is set)."""

    def __init__(self, bus: Any, *, create: bool = False, inline_max: int = INLINE_MAX) -> None:
        self.bus = bus
        self.create = create
        self.inline_max = inline_max
        self._obs: Any = None

    async def store(self) -> Any:
        if self._obs is None:
            from nats.js.api import ObjectStoreConfig
            from nats.js.errors import BucketNotFoundError, NotFoundError

            try:
                self._obs = await self.bus.js.object_store(BLOBS.name)
            except (BucketNotFoundError, NotFoundError):
                if not self.create:
                    raise
                cfg = ObjectStoreConfig(bucket=BLOBS.name, ttl=BLOBS.ttl_s, description=BLOBS.description)
                self._obs = await self.bus.js.create_object_store(BLOBS.name, config=cfg)
        return self._obs

    async def put(self, data: bytes, content_type: str = "", filename: str = "", suffix: str = "") -> Blob:
        """Store `data` under a new random name (ending in `suffix`, e.g. ".png"), whatever its size."""
        name = secrets.token_urlsafe(24) + suffix
        await (await self.store()).put(name, data)
        return Blob(name=name, size=len(data), content_type=content_type, filename=filename)

    async def get(self, blob: Blob) -> bytes:
        """The blob's bytes, fetched from the store when it is not inline."""
        if not blob.name:
            return blob.data
        from nats.js.errors import NotFoundError, ObjectDeletedError, ObjectNotFoundError

        try:
            res = await (await self.store()).get(blob.name)
        except (ObjectNotFoundError, ObjectDeletedError, NotFoundError):
            raise BlobMissing(f"blob {blob.name} is gone (expired?)") from None
        return res.data

    async def pack(self, msg: M) -> M:
        """`msg` with each inline blob moved to the store once the message's inline budget is spent."""
        budget = [self.inline_max]

        async def one(b: Blob) -> Blob:
            if b.name or len(b.data) <= budget[0]:
                budget[0] -= len(b.data)
                return b
            stored = await self.put(b.data, b.content_type, b.filename)
            return stored

        return await _map_blobs(msg, one)

    async def unpack(self, msg: M) -> M:
        """`msg` with every stored blob fetched inline (what engines and the gateway's encoders want)."""

        async def one(b: Blob) -> Blob:
            if not b.name:
                return b
            return Blob(data=await self.get(b), size=b.size, content_type=b.content_type, filename=b.filename)

        return await _map_blobs(msg, one)


async def _map_blobs(msg: Any, fn: Any) -> Any:
    """Apply async `fn` to every Blob field (or list of Blobs) at the top level of a struct."""
    changes: dict[str, Any] = {}
    for name in msg.__struct_fields__:
        value = getattr(msg, name)
        if isinstance(value, Blob):
            new = await fn(value)
            if new is not value:
                changes[name] = new
        elif isinstance(value, list) and value and isinstance(value[0], Blob):
            items = [await fn(b) for b in value]
            if any(a is not b for a, b in zip(items, value)):
                changes[name] = items
    return msgspec.structs.replace(msg, **changes) if changes else msg
