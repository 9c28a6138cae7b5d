"""Bytes on the bus: small ones ride inline in a message, large ones go to the `coderai_blobs` object store.

NATS keeps its default 1 MB max payload, so a message never carries more than `INLINE_MAX` bytes of blobs in
all; the rest are stored under random names (unguessable, so the gateway may serve them as image URLs) and
expire after the bucket's TTL.
"""

from __future__ import annotations

import asyncio

import logging
import secrets
from typing import Any, TypeVar

import msgspec

from coderai.contracts.media import Blob
from coderai.contracts.topology import BLOBS
from coderai.runtime.members import requester

log = logging.getLogger("coderai.blobs")

INLINE_MAX = 192 * 1024
"""Bytes of blobs one message may carry inline, all blobs together."""

M = TypeVar("M")


class BlobMissing(Exception):
    """A blob's stored object is gone (expired, or never written)."""


class BlobStore:
    """Packs and unpacks `Blob`s; binds the object store on first use (created when `create` is set)."""

    def __init__(self, bus: Any, *, create: bool = False, inline_max: int = INLINE_MAX, max_bytes: int = 0) -> None:
        self.bus = bus
        self.create = create
        self.max_bytes = max_bytes  # the store's cap when this creates it (0: none)
        self.inline_max = inline_max
        self._obs: Any = None

    async def store(self) -> Any:
        if self._obs is None:
            self._obs = await self.bus.object_store(BLOBS, create=self.create, max_bytes=self.max_bytes)
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


PIECE = 512 * 1024
"""Bytes of a blob one proxied message carries (NATS' default max payload is 1 MB)."""


class BlobProxy(BlobStore):
    """A node's blobs: read and written through the head's blob service (`BlobService`) by name, never in the
    object store itself, so a node can neither list, read without the name, overwrite nor purge anything."""

    async def store(self) -> Any:
        raise RuntimeError("a node has no access to the object store; it reads and writes through the blob service")

    async def put(self, data: bytes, content_type: str = "", filename: str = "", suffix: str = "") -> Blob:
        from coderai.contracts.media import BlobWrite
        from coderai.contracts.subjects import CMD_BLOB_WRITE

        from coderai.contracts import BusError

        upload, off, waits = secrets.token_urlsafe(16), 0, 0
        while True:
            piece = data[off : off + PIECE]
            last = off + len(piece) >= len(data)
            try:
                ack = await self.bus.request(
                    CMD_BLOB_WRITE,
                    BlobWrite(
                        upload=upload,
                        offset=off,
                        data=piece,
                        last=last,
                        content_type=content_type,
                        filename=filename,
                        suffix=suffix,
                    ),
                    timeout=30.0,
                )
            except BusError as exc:  # the gateway holds as many unfinished uploads as it may: wait for room
                if exc.code != "busy" or waits >= 30:
                    raise
                waits += 1
                await asyncio.sleep(min(2.0, 0.1 * waits))
                continue
            off += len(piece)
            if last:
                return ack.blob

    async def get(self, blob: Blob) -> bytes:
        from coderai.contracts import BusError
        from coderai.contracts.media import BlobRead
        from coderai.contracts.subjects import CMD_BLOB_READ

        if not blob.name:
            return blob.data
        out, size = bytearray(), None
        while size is None or len(out) < size:
            try:
                piece = await self.bus.request(
                    CMD_BLOB_READ, BlobRead(name=blob.name, offset=len(out), limit=PIECE), timeout=30.0
                )
            except BusError as exc:
                if exc.code == "not_found":
                    raise BlobMissing(f"blob {blob.name} is gone (expired?)") from None
                raise
            size = piece.size
            if not piece.data and len(out) < size:
                raise BlobMissing(f"blob {blob.name} ended early")
            out += piece.data
        return bytes(out)


def sender_of(m: Any) -> str:
    """Who sent a bus request (`members.requester`): "node:<id>", "service", or "other" for a reply subject that is
    neither inbox (so a node cannot pass for a service by asking for the answer on one of its own subjects)."""
    who = requester(getattr(m, "reply", "") or "")
    return "other" if who is None else f"node:{who}" if who else "service"


class BlobService:
    """The service side of `BlobProxy` (run by every gateway): reads by name, writes as new random names.
    The last blobs read stay in memory, so a blob read piece by piece is fetched from the store once."""

    UPLOAD_TTL_S = 600.0
    MAX_UPLOAD = 1 << 30
    # unfinished uploads are held in memory until their last piece: bounded in all, and per sender (a node's
    # requests come from its own inbox, `_N.<id>.`), so one node cannot take the gateway's memory
    MAX_OPEN_BYTES = 512 << 20
    MAX_OPEN_PER_SENDER = 16

    def __init__(self, store: BlobStore) -> None:
        self.blobs = store
        self._recent: dict[str, bytes] = {}
        self._uploads: dict[str, tuple[bytearray, float]] = {}
        self._senders: dict[str, str] = {}  # an unfinished upload -> who sends it

    async def start(self, bus: Any) -> list[Any]:
        from coderai.contracts.subjects import CMD_BLOB_READ, CMD_BLOB_WRITE

        return [
            await bus.serve(CMD_BLOB_READ, self.read, queue="blobs"),
            await bus.serve(CMD_BLOB_WRITE, self.write, queue="blobs"),
        ]

    async def read(self, req: Any, _m: Any) -> Any:
        from coderai.contracts import BusError
        from coderai.contracts.media import BlobPiece

        data = self._recent.get(req.name)
        if data is None:
            try:
                data = await self.blobs.get(Blob(name=req.name))
            except BlobMissing:
                raise BusError("not_found", "no such blob", retryable=False) from None
            self._recent[req.name] = data
            while len(self._recent) > 4:
                self._recent.pop(next(iter(self._recent)))
        limit = max(1, min(req.limit, PIECE))
        return BlobPiece(data=data[req.offset : req.offset + limit], size=len(data))

    async def write(self, req: Any, m: Any) -> Any:
        import time

        from coderai.contracts import BusError
        from coderai.contracts.media import BlobWritten

        now = time.monotonic()
        self._uploads = {k: v for k, v in self._uploads.items() if v[1] > now}
        self._senders = {k: v for k, v in self._senders.items() if k in self._uploads}
        buf = self._uploads.get(req.upload, (bytearray(), 0.0))[0] if req.offset else bytearray()
        if req.offset != len(buf):
            raise BusError("bad_request", f"upload {req.upload}: offset {req.offset}, have {len(buf)}", retryable=False)
        if len(buf) + len(req.data) > self.MAX_UPLOAD:
            raise BusError("bad_request", "blob too large", retryable=False)
        if not req.last:
            sender = sender_of(m)
            if (
                req.upload not in self._uploads
                and sum(1 for s in self._senders.values() if s == sender) >= self.MAX_OPEN_PER_SENDER
            ):
                raise BusError(
                    "busy", f"{self.MAX_OPEN_PER_SENDER} unfinished blob uploads of this sender already", retryable=True
                )
            if sum(len(b) for b, _ in self._uploads.values()) + len(req.data) > self.MAX_OPEN_BYTES:
                raise BusError("busy", "the gateway holds as many unfinished blob uploads as it may", retryable=True)
        buf += req.data
        if not req.last:
            self._uploads[req.upload] = (buf, now + self.UPLOAD_TTL_S)
            self._senders[req.upload] = sender
            return BlobWritten(received=len(buf))
        self._uploads.pop(req.upload, None)
        self._senders.pop(req.upload, None)
        suffix = req.suffix if len(req.suffix) <= 16 and req.suffix.replace(".", "").isalnum() else ""
        blob = await self.blobs.put(bytes(buf), req.content_type[:100], req.filename[:200], suffix=suffix)
        return BlobWritten(received=len(buf), blob=blob)
