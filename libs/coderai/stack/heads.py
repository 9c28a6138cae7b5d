"""Several heads: what a head of an HA cluster keeps about the others (`Head`, kept in the data dir) and the invite
that makes a machine a head; what `coderai up --head` does once its nats-server is up is `coderai.stack.ha`, and
`coderai heads invite` is `coderai.stack.invite`.

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

import os
from pathlib import Path

import msgspec

from coderai.runtime import members

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


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` readable by this user only (0600, in a 0700 folder made if missing)."""
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
    tls = data / "nats" / "tls"
    tls.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name, text, mode in (
        ("ca.pem", invite.ca_pem, 0o644),
        ("ca-key.pem", invite.ca_key_pem, 0o600),
        ("server.pem", invite.cert_pem, 0o644),
        ("server-key.pem", invite.key_pem, 0o600),
    ):
        write_private(tls / name, text.encode())
        (tls / name).chmod(mode)
    for name, value in (
        ("nats-service.password", invite.service_password),
        ("redis.password", invite.redis_password),
        ("route.password", invite.route_password),
    ):
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
        write_private(data / "nats" / "members.json", invite.members.encode())
    if invite.models and not (data / "models.toml").exists():
        (data / "models.toml").write_text(invite.models)
    if invite.keys and not (data / "keys.toml").exists():
        write_private(data / "keys.toml", invite.keys.encode())
    save(data, merge(load(data), invite.heads))


def urls(heads: list[Head]) -> list[str]:
    """The heads' NATS URLs, as a worker dials them."""
    return [f"nats://{_host(h.address)}:{h.nats_port}" for h in heads]
