"""What `coderai up --head` does once its nats-server is up: record itself in the replicated `coderai_heads`
bucket and learn the others there (`take_place`, then `Keeper` every few seconds), raise every stream to the replica
count the heads call for, and run its Redis Sentinel beside the others'. `known` and `client_urls` also tell the
gateway and the scheduler the cluster's heads."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from coderai.contracts.topology import HEADS
from coderai.stack.heads import REDIS_MASTER_NAME, Head, load, merge, replicas, save, sentinel_quorum, urls


async def _bucket(bus: Any) -> Any:
    from coderai.runtime.stores import key_value

    return await key_value(bus, HEADS)


async def known(bus: Any) -> list[Head]:
    """Every head recorded in `coderai_heads`."""
    kv = await _bucket(bus)
    out = []
    for key in await _keys(kv, "head."):
        entry = await kv.get(key)
        out.append(msgspec.json.decode(entry.value, type=Head))
    return sorted(out, key=lambda h: h.node_id)


async def client_urls(bus: Any) -> list[str]:
    """Every head's NATS URL, for a joining worker; none with a single head (no `coderai_heads` bucket, and none
    made here)."""
    from nats.js.errors import BucketNotFoundError

    try:
        await bus.js.key_value(HEADS.name)
    except BucketNotFoundError:
        return []
    return urls(await known(bus))


async def _keys(kv: Any, prefix: str) -> list[str]:
    from nats.js.errors import NoKeysError

    try:
        return [k for k in await kv.keys() if k.startswith(prefix)]
    except NoKeysError:
        return []


async def announce(bus: Any, me: Head) -> list[Head]:
    """Record this head in `coderai_heads`; every head recorded, this one included."""
    kv = await _bucket(bus)
    await kv.put(f"head.{me.node_id}", msgspec.json.encode(me))
    return await known(bus)


async def raise_replicas(bus: Any, count: int) -> None:
    """Raise every stream (buckets and object stores are streams too) to `count` replicas, the way a service raises
    the ones it binds (`stores.fit_replicas`): the ones made before this head joined had fewer, and nats-server copies
    the data online. One that cannot be raised yet (a head that joined a moment ago is not placeable) is left to the
    next round (`Keeper`)."""
    from coderai.runtime.stores import fit_replicas

    bus.replicas = count
    async for name in _stream_names(bus):
        await fit_replicas(bus, name)


async def _settle(bus: Any, data: Path, found: list[Head]) -> list[Head]:
    """The heads `found` in the bucket merged into those kept in the data dir, kept there, and every stream raised to
    the replica count they call for; the heads."""
    heads = merge(load(data), found)
    save(data, heads)
    await raise_replicas(bus, replicas(heads))
    return heads


async def _stream_names(bus: Any):
    offset = 0
    while True:
        reply = await bus.nc.request("$JS.API.STREAM.NAMES", json.dumps({"offset": offset}).encode(), timeout=5)
        body = json.loads(reply.data)
        names = body.get("streams") or []
        for n in names:
            yield n
        offset += len(names)
        if not names or offset >= body.get("total", 0):
            return


async def take_place(service_url: str, tls: Any, me: Head, data: Path) -> list[Head]:
    """What a head does once its nats-server is up, before its services start: wait until the cluster's JetStream
    answers (on a first head, until a second has joined), record itself, raise every stream made with fewer replicas
    than the heads now call for, and keep the heads it learned in the data dir (for its routes and its Redis URL at
    the next start). The cluster's heads, this one included."""
    from coderai.runtime.bus import Bus
    from coderai.runtime.tls import client_context

    bus = await Bus.connect(service_url, f"head:{me.node_id}", tls=client_context(tls.ca_pem) if tls else None)
    bus.replicas = replicas(merge(load(data), [me]))
    try:
        said = time.monotonic()
        while True:
            try:
                found = await announce(bus, me)
                break
            except Exception as exc:  # no JetStream leader yet while the cluster forms
                if time.monotonic() - said > 10:
                    said = time.monotonic()
                    print(
                        f"waiting for the cluster's JetStream ({exc}); a first head waits for a second "
                        "(coderai heads invite --address ADDR --out FILE)",
                        flush=True,
                    )
                await asyncio.sleep(0.5)
        return await _settle(bus, data, found)
    finally:
        await bus.close()


def sentinel_for(data: Path, heads: list[Head], master: str, me: Head, password: str) -> Any:
    """This head's sentinel: on its address, watching `master`, with the quorum for this many heads. A failover
    starts after 2 s without an answer from the master (short enough for a request to wait it out, long enough
    that a slow moment is not one). Its failover timeout is short too: a sentinel that took part in an election
    nobody won (two survivors voting for themselves) tries again only after twice that, and with 10 s a Redis
    failover then took over 16 s (tests/ha/test_failover_clients)."""
    from coderai.runtime.embedded_redis import RedisSentinel

    return RedisSentinel(
        data / "sentinel",
        master,
        name=REDIS_MASTER_NAME,
        port=me.sentinel_port,
        host=me.address,
        password=password,
        quorum=sentinel_quorum(heads),
        down_after_ms=2000,
        failover_timeout_ms=2000,
    )


def _sentinel(h: Head) -> Any:
    """A client of `h`'s sentinel that gives up within a second (a dead head's is skipped, not waited for)."""
    import redis

    host, _, port = h.sentinel.rpartition(":")
    return redis.Redis(
        host=host.strip("[]"), port=int(port), socket_timeout=1, socket_connect_timeout=1, decode_responses=True
    )


def sentinel_master(heads: list[Head], exclude: str = "") -> str | None:
    """The Redis master ("host:port") the heads' sentinels (but `exclude`'s) name, or None when none answers."""
    import redis

    for h in heads:
        if h.node_id == exclude:
            continue
        try:
            with _sentinel(h) as r:
                got = r.sentinel_get_master_addr_by_name(REDIS_MASTER_NAME)
        except (redis.RedisError, OSError):
            continue
        if got:
            return f"{got[0]}:{got[1]}"
    return None


def set_quorum(heads: list[Head], me: str) -> None:
    """Tell every other head's sentinel the quorum for this many heads (each reads it from its config at its own
    next start). Heads that do not answer are skipped."""
    import redis

    for h in heads:
        if h.node_id == me:
            continue
        try:
            with _sentinel(h) as r:
                r.execute_command("SENTINEL", "SET", REDIS_MASTER_NAME, "quorum", str(sentinel_quorum(heads)))
        except (redis.RedisError, OSError):
            continue


class Keeper(threading.Thread):
    """A head's watch on the others, every `every_s` while `coderai up` runs: learn the heads recorded in
    `coderai_heads` (kept in the data dir for the next start) and raise every stream to the replica count they call
    for. A stream a service made before the last head joined (with the replica count it was started with) is raised
    here within one round, so no stream is left with fewer copies than the heads can hold."""

    def __init__(self, service_url: str, tls: Any, me: Head, data: Path, every_s: float = 10.0) -> None:
        super().__init__(name="heads-keeper", daemon=True)
        self.service_url, self.tls, self.me, self.data, self.every_s = service_url, tls, me, data, every_s
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                asyncio.run(self._round())
            except Exception as exc:  # NATS away for a moment: the next round tries again
                print(f"heads: {type(exc).__name__}: {exc}", flush=True)

    async def _round(self) -> None:
        from coderai.runtime.bus import Bus
        from coderai.runtime.tls import client_context

        bus = await Bus.connect(
            self.service_url,
            f"head:{self.me.node_id}",
            connect_timeout_s=5,
            tls=client_context(self.tls.ca_pem) if self.tls else None,
        )
        try:
            await _settle(bus, self.data, await known(bus))
        finally:
            await bus.close()
