"""JetStream topology: KV buckets, streams and object stores, bound, or made when missing (on disk, with the
bus's replica count; one found with fewer replicas is raised to it, as when a head joins), and an object store's
cap fitted to what the server's disk can hold."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from coderai.contracts.topology import BucketSpec, StreamSpec

if TYPE_CHECKING:
    from nats.js.client import JetStreamContext
    from nats.js.kv import KeyValue
    from nats.js.object_store import ObjectStore


class JetStreamBus(Protocol):
    """What these functions use of a `runtime.bus.Bus` (which imports this module)."""

    js: JetStreamContext
    replicas: int  # streams and buckets made (or found with fewer) get this many
    fitted: set[str]  # streams whose replica count this connection has checked


log = logging.getLogger("coderai.bus")

INSUFFICIENT_STORAGE = 10047  # JetStream's error code: a stream or store asks for more than the server may keep


async def fit_replicas(bus: JetStreamBus, stream: str) -> None:
    """Raise `stream` to the bus's replica count, once per connection; nats-server moves its data online. Left as
    it is where the caller may not (a node's rights name no stream API, a service's only those of the streams it
    writes: members.manages; the heads' Keeper raises the rest) or the cluster has too few servers."""
    from coderai.runtime.members import manages

    if bus.replicas <= 1 or stream in bus.fitted or not manages(getattr(bus, "role", ""), stream):
        return
    bus.fitted.add(stream)
    try:
        info = await bus.js.stream_info(stream)
        if (info.config.num_replicas or 1) < bus.replicas:
            cfg = info.config
            cfg.num_replicas = bus.replicas
            await bus.js.update_stream(cfg)
            log.info("stream %s raised to %d replicas", stream, bus.replicas)
    except Exception as exc:  # tried again by the next connection (a restart, another head)
        bus.fitted.discard(stream)
        log.warning("stream %s not raised to %d replicas: %s", stream, bus.replicas, exc)


async def key_value(bus: JetStreamBus, spec: BucketSpec) -> KeyValue:
    """Bind a KV bucket, creating it (idempotently) with its spec's TTL and history, on disk (file storage, in
    the server's store dir), so what it holds survives a restart of the server."""
    from nats.js.api import KeyValueConfig, StorageType
    from nats.js.errors import BucketNotFoundError

    try:
        kv = await bus.js.key_value(spec.name)
    except BucketNotFoundError:
        cfg = KeyValueConfig(
            bucket=spec.name,
            ttl=spec.ttl_s or None,
            history=spec.history,
            description=spec.description,
            storage=StorageType.FILE,
            direct=True,  # direct: a node reads its own key by name
            replicas=bus.replicas,
        )
        return await bus.js.create_key_value(cfg)
    await fit_replicas(bus, f"KV_{spec.name}")
    return kv


async def ensure_stream(bus: JetStreamBus, spec: StreamSpec) -> None:
    """Create a stream if missing (an existing one keeps its limits), on disk like every bucket."""
    from nats.js.api import RetentionPolicy, StorageType, StreamConfig
    from nats.js.errors import NotFoundError

    try:
        await bus.js.stream_info(spec.name)
    except NotFoundError:
        retention = RetentionPolicy.WORK_QUEUE if spec.name == "WORK" else RetentionPolicy.LIMITS
        cfg = StreamConfig(
            name=spec.name,
            subjects=list(spec.subjects),
            max_age=spec.max_age_s or None,
            retention=retention,
            description=spec.description,
            storage=StorageType.FILE,
            num_replicas=bus.replicas,
        )
        try:
            await bus.js.add_stream(cfg)
        except Exception as exc:  # another service may have created it a moment ago
            log.debug("add_stream %s: %s", spec.name, exc)
            await bus.js.stream_info(spec.name)
        return
    await fit_replicas(bus, spec.name)


async def object_store(bus: JetStreamBus, spec: BucketSpec, *, create: bool = False, max_bytes: int = 0) -> ObjectStore:
    """Bind the object store `spec` names (`BLOBS`, `FILES`). Missing: created with its spec's TTL and
    description and at most `max_bytes` (0: no cap) when `create`, else nats-py's BucketNotFoundError."""
    from nats.js.api import ObjectStoreConfig
    from nats.js.errors import BadRequestError, BucketNotFoundError, ServerError

    js = bus.js
    try:
        store = await js.object_store(spec.name)
    except BucketNotFoundError:
        if not create:
            raise
    else:
        await fit_replicas(bus, f"OBJ_{spec.name}")
        return store
    while True:
        cfg = ObjectStoreConfig(
            bucket=spec.name,
            ttl=spec.ttl_s or None,
            description=spec.description,
            max_bytes=max_bytes or None,
            replicas=bus.replicas,
        )
        try:
            return await js.create_object_store(spec.name, config=cfg)
        except ServerError as exc:
            # nats-server refuses a cap over its store limit (by default 75 % of the free disk): on a small
            # disk the store is made with half the cap, down to 64 MiB, rather than not at all
            if exc.err_code != INSUFFICIENT_STORAGE or not max_bytes or max_bytes // 2 < 64 << 20:
                raise
            log.warning(
                "the %s store's cap of %d MiB does not fit this server's disk; trying %d MiB",
                spec.name,
                max_bytes >> 20,
                max_bytes >> 21,
            )
            max_bytes //= 2
        except BadRequestError as exc:  # another service created it a moment ago, with other limits: bind it
            log.debug("create_object_store %s: %s", spec.name, exc)
            try:
                return await js.object_store(spec.name)
            except BucketNotFoundError:
                raise exc from None


async def object_chunks(
    bus: JetStreamBus, spec: BucketSpec, store: ObjectStore, name: str
) -> tuple[int, AsyncIterator[bytes]]:
    """The size of object `name` in `store` (the object store `spec` names) and an async iterator of its chunks as
    JetStream holds them (128 KiB
    each by default), read one at a time from an ordered consumer: a download of a large file never holds the
    whole of it, where nats-py's `get` gathers it into one bytes. The digest is checked at the end; a mismatch
    raises (the download ends cut short rather than whole and wrong). nats-py's ObjectNotFoundError when missing."""
    from base64 import urlsafe_b64decode
    from hashlib import sha256

    from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE

    info = await store.get_info(name)
    if info.is_link():
        raise ValueError(f"object {name} is a link")

    async def chunks() -> AsyncIterator[bytes]:
        if not info.size:
            return
        sub = await bus.js.subscribe(
            OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=spec.name, obj=info.nuid), ordered_consumer=True
        )
        digest, got = sha256(), 0
        try:
            async for msg in sub.messages:
                digest.update(msg.data)
                got += len(msg.data)
                yield msg.data
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        want = (info.digest or "").removeprefix("SHA-256=")
        if got != info.size or (want and digest.digest() != urlsafe_b64decode(want + "=" * (-len(want) % 4))):
            raise ValueError(f"object {name}: {got} bytes read of {info.size}, or its digest differs")

    return info.size or 0, chunks()
