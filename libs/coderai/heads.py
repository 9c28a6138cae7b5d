"""Several heads: what a head of an HA cluster keeps about the others, the invite that makes a machine a head, and
what `coderai up --head` does once its nats-server is up.

A head is a control-plane machine: it runs a nats-server routed to the other heads', a Redis (the master, or a
replica of it) with a sentinel, and every service (the singletons acting only under their lease). A new head gets
from an existing one, in an invite the operator makes there (`coderai heads invite`, which reads that head's data dir,
so only whoever runs it can make one): the heads' CA and a certificate of its own for its address, the route
password, the service login, the Redis password, the cluster token (so it answers joins too), the member registry
and the models file. The invite is the control plane's keys: it is written 0600, is good until `--ttl`, and is
meant to be copied privately and deleted once used. The cluster token alone never makes a head: it lets a worker
join, not the control plane.

nats-server runs JetStream clustered on a head from its first start, and clustered JetStream answers only once a
second server has joined: a first head waits for the second. A single `coderai up` (no `--head`) cannot be made a
head later with its data: nats-server 2.15 deletes the streams of a standalone server that joins a cluster
("Detected orphaned stream ..., will cleanup"), so an HA cluster starts as heads.

Every head records itself in the replicated `coderai_heads` bucket (`head.<node id>`: its address and ports), which
is how the others, the next invite and a restarted head learn the cluster's heads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from coderai.contracts.topology import HEADS

HEADS_FILE = "heads.json"
NATS_PORT, ROUTE_PORT, REDIS_PORT, SENTINEL_PORT = 4222, 6222, 6379, 26379
REDIS_MASTER_NAME = "coderai"
INVITE_TTL_S = 3600.0


class Head(msgspec.Struct, frozen=True):
    """One head: its node id and where the others reach its nats-server, routes, Redis and sentinel."""

    node_id: str
    address: str
    nats_port: int = NATS_PORT
    route_port: int = ROUTE_PORT
    redis_port: int = REDIS_PORT
    sentinel_port: int = SENTINEL_PORT

    @property
    def route(self) -> str:
        return f"{_host(self.address)}:{self.route_port}"

    @property
    def sentinel(self) -> str:
        return f"{_host(self.address)}:{self.sentinel_port}"

    @property
    def redis(self) -> str:
        return f"{self.address}:{self.redis_port}"


class Invite(msgspec.Struct, kw_only=True):
    """What `coderai heads invite` hands a new head (a 0600 file: it holds the control plane's secrets)."""

    expires_at: float
    address: str
    heads: list[Head]
    ca_pem: str
    ca_key_pem: str
    cert_pem: str
    key_pem: str
    route_password: str
    service_password: str
    redis_password: str
    service_passwords: dict[str, str] = {}  # each head service's own NATS password (members.SERVICE_ROLES), by role:
    # every head accepts every head's services (one reconnects to another head when its own dies), so they share them
    cluster_token: str = ""
    members: str = ""  # members.json
    models: str = ""  # models.toml
    keys: str = ""  # keys.toml (hashes only): the first head's admin key works at every gateway
    seal_key: str = ""  # secrets/reasoning-seal.key: reasoning one head's gateway signed, every head's takes back
    blob_url_key: str = ""  # secrets/blob-url.key: a blob URL one head's gateway signed, every head's serves


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def replicas(heads: list[Head]) -> int:
    """JetStream copies of every stream and bucket: one per head, three at most (a RAFT group of three outlives one
    head; more copies only cost writes)."""
    return max(1, min(3, len(heads)))


def sentinel_quorum(heads: list[Head]) -> int:
    """Sentinels that must agree a master is down: a majority of the heads, so one cut-off head cannot fail over."""
    return len(heads) // 2 + 1


def sentinel_url(heads: list[Head], password: str) -> str:
    """The Redis URL every service of a head uses: every head's sentinel, the master's password."""
    from urllib.parse import quote

    return f"redis+sentinel://:{quote(password, safe='')}@{','.join(h.sentinel for h in heads)}/{REDIS_MASTER_NAME}"


def load(data: Path) -> list[Head]:
    try:
        return msgspec.json.decode((data / HEADS_FILE).read_bytes(), type=list[Head])
    except FileNotFoundError:
        return []


def save(data: Path, heads: list[Head]) -> None:
    (data / HEADS_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(sorted(heads, key=lambda h: h.node_id))))


def merge(*lists: list[Head]) -> list[Head]:
    """Heads by node id, a later list's record winning (a head that moved)."""
    out: dict[str, Head] = {}
    for heads in lists:
        out.update({h.node_id: h for h in heads})
    return sorted(out.values(), key=lambda h: h.node_id)


def _private(path: Path, data: bytes) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def head_certificate(ca_pem: str, ca_key_pem: str, address: str) -> tuple[str, str]:
    """(certificate, key) PEM for a head at `address`, signed by the heads' CA: for its clients (TLS beyond loopback)
    and for its routes to the other heads (client auth both ways)."""
    from coderai.runtime.tls import issue

    return issue(ca_pem, ca_key_pem, [address])


def install(data: Path, invite: Invite) -> None:
    """Put what an invite carries into a new head's data dir, where `coderai up` reads it (secrets 0600). Files the
    dir already has are kept: a head restarted with the same invite keeps its own state."""
    from coderai.runtime import members

    tls = data / "nats" / "tls"
    tls.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name, text, mode in (("ca.pem", invite.ca_pem, 0o644), ("ca-key.pem", invite.ca_key_pem, 0o600),
                             ("server.pem", invite.cert_pem, 0o644), ("server-key.pem", invite.key_pem, 0o600)):
        _private(tls / name, text.encode())
        (tls / name).chmod(mode)
    for name, value in (("nats-service.password", invite.service_password), ("redis.password", invite.redis_password),
                        ("route.password", invite.route_password)):
        members.write_secret(data / "secrets" / name, value)
    for role, password in invite.service_passwords.items():
        if role in members.SERVICE_ROLES:
            members.write_secret(data / "secrets" / members.service_secret(role), password)
    if invite.cluster_token:
        members.write_secret(data / "secrets" / "cluster.token", invite.cluster_token)
    if invite.seal_key:
        members.write_secret(data / "secrets" / "reasoning-seal.key", invite.seal_key)
    if invite.blob_url_key:
        members.write_secret(data / "secrets" / "blob-url.key", invite.blob_url_key)
    if invite.members and not (data / "nats" / "members.json").exists():
        _private(data / "nats" / "members.json", invite.members.encode())
    if invite.models and not (data / "models.toml").exists():
        (data / "models.toml").write_text(invite.models)
    if invite.keys and not (data / "keys.toml").exists():
        _private(data / "keys.toml", invite.keys.encode())
    save(data, merge(load(data), invite.heads))


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


def urls(heads: list[Head]) -> list[str]:
    """The heads' NATS URLs, as a worker dials them."""
    return [f"nats://{_host(h.address)}:{h.nats_port}" for h in heads]


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
            except Exception as exc:  # noqa: BLE001 - no JetStream leader yet while the cluster forms
                if time.monotonic() - said > 10:
                    said = time.monotonic()
                    print(f"waiting for the cluster's JetStream ({exc}); a first head waits for a second "
                          "(coderai heads invite --address ADDR --out FILE)", flush=True)
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
    from coderai.runtime.embedded import RedisSentinel

    return RedisSentinel(data / "sentinel", master, name=REDIS_MASTER_NAME, port=me.sentinel_port, host=me.address,
                         password=password, quorum=sentinel_quorum(heads), down_after_ms=2000,
                         failover_timeout_ms=2000)


def _sentinel(h: Head) -> Any:
    """A client of `h`'s sentinel that gives up within a second (a dead head's is skipped, not waited for)."""
    import redis

    host, _, port = h.sentinel.rpartition(":")
    return redis.Redis(host=host.strip("[]"), port=int(port), socket_timeout=1, socket_connect_timeout=1,
                       decode_responses=True)


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
            except Exception as exc:  # noqa: BLE001 - NATS away for a moment: the next round tries again
                print(f"heads: {type(exc).__name__}: {exc}", flush=True)

    async def _round(self) -> None:
        from coderai.runtime.bus import Bus
        from coderai.runtime.tls import client_context

        bus = await Bus.connect(self.service_url, f"head:{self.me.node_id}", connect_timeout_s=5,
                                tls=client_context(self.tls.ca_pem) if self.tls else None)
        try:
            await _settle(bus, self.data, await known(bus))
        finally:
            await bus.close()


# --- `coderai heads` ---------------------------------------------------------------------------------------------

def invite_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="coderai heads invite",
                                 description="make an invite that makes another machine a head of this cluster")
    ap.add_argument("--data-dir", default=os.environ.get("CODERAI_DATA_DIR", "~/.coderai"),
                    help="this head's data dir (its `coderai up` must be running)")
    ap.add_argument("--address", required=True, help="the new head's address, as the other heads reach it")
    ap.add_argument("--out", required=True, help="where to write the invite (mode 0600: it holds the cluster's secrets)")
    ap.add_argument("--ttl", type=float, default=INVITE_TTL_S, help="seconds the invite is good for (default 3600)")
    ap.add_argument("--cluster-token", default=os.environ.get("CODERAI_CLUSTER_TOKEN", ""),
                    help="the cluster token, so the new head answers workers' joins (default: this head's)")
    args = ap.parse_args(argv)
    data = Path(os.path.expanduser(args.data_dir)).resolve()
    tls, sec = data / "nats" / "tls", data / "secrets"
    if not (tls / "ca-key.pem").exists() or not (sec / "route.password").exists():
        print(f"coderai heads invite: {data} is not a head's data dir (run `coderai up --head --address ...` first)",
              file=sys.stderr)
        return 2
    from coderai.runtime import members
    from coderai.up import service_bus

    token = args.cluster_token or (members.read_secret(sec / "cluster.token") if (sec / "cluster.token").exists() else "")
    cert, key = head_certificate((tls / "ca.pem").read_text(), (tls / "ca-key.pem").read_text(), args.address)
    expires_at = time.time() + args.ttl

    async def go() -> list[Head]:
        bus = await service_bus(data, "heads-invite")
        try:
            return await asyncio.wait_for(known(bus), 10)
        finally:
            await bus.close()

    try:
        heads = asyncio.run(go())
    except Exception:  # noqa: BLE001 - a first head's JetStream answers once a second head is up: it alone, then
        heads = []
    models, keys = data / "models.toml", data / "keys.toml"
    invite = Invite(expires_at=expires_at, address=args.address, heads=merge(load(data), heads),
                    ca_pem=(tls / "ca.pem").read_text(), ca_key_pem=(tls / "ca-key.pem").read_text(), cert_pem=cert,
                    key_pem=key, route_password=members.read_secret(sec / "route.password"),
                    service_password=members.read_secret(sec / "nats-service.password"),
                    service_passwords={role: members.read_secret(sec / members.service_secret(role))
                                       for role in members.SERVICE_ROLES if (sec / members.service_secret(role)).exists()},
                    redis_password=members.read_secret(sec / "redis.password"), cluster_token=token,
                    members=(data / "nats" / "members.json").read_text(),
                    models=models.read_text() if models.exists() else "",
                    keys=keys.read_text() if keys.exists() else "",
                    seal_key=members.ensure_secret(sec / "reasoning-seal.key"),
                    blob_url_key=members.ensure_secret(sec / "blob-url.key"))
    _private(Path(args.out), msgspec.json.encode(invite))
    print(f"invite for a head at {args.address} written to {args.out} (good for {args.ttl:.0f} s; it holds the "
          "cluster's keys: copy it privately, delete it once used).\n"
          f"Copy it there privately and run: coderai up --head --address {args.address} --join {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["invite"]:
        return invite_main(argv[1:])
    print("usage: coderai heads invite --address ADDR --out FILE [--data-dir DIR] [--ttl S]", file=sys.stderr)
    return 2
