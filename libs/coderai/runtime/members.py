"""Who may log in to the head's NATS, and with which rights: the member registry and the `authorization` block
of nats-server's config rendered from it.

Every login belongs to one identity. Services log in as `service` with a random password made on the head's
first start. Each node (a worker on any machine, this box's own included) and each rented pod logs in as
`node-<id>` / `pod-<id>` with a password only it knows: the registry keeps a bcrypt hash. User `join` may only
ask to join (its password comes from the cluster token, and it reaches nothing else). The head adds and removes
members by rewriting the config and sending nats-server SIGHUP, which also disconnects a removed member at once.

A node's rights are the least it needs (docs/security.md lists them): its own heartbeat, engine, command and
inbox subjects, replies only to requests it was sent (`allow_responses`), its own assignment key, events and
training reports under its own id, and blobs only through the gateway's blob service, by their random names.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from pathlib import Path

import msgspec

from coderai.contracts.topology import ASSIGNMENTS, WORK
from coderai.runtime.cluster import JOIN_USER

SERVICE_USER = "service"
JOIN_SUBJECTS = ("coderai.join.hello", "coderai.join.prove")
JOIN_INBOX = "_JOIN"
RESPONSE_WINDOW = "1h"
"""How long a node may keep answering one request (a long generation streams frames for as long as it runs)."""
BCRYPT_COST = 8
"""The passwords are 256 random bits, so the hash's cost is not what protects them; a low cost keeps a login fast."""


class Member(msgspec.Struct, kw_only=True):
    node_id: str
    kind: str = "node"  # "node" or "pod"
    password_hash: str  # bcrypt
    joined_at: float = 0.0
    expires_at: float = 0.0  # pods: their credentials end with the lease (0: never)
    addr: str = ""  # the address the head saw the join come from
    work: list[str] = []  # the `WORK` consumers of the models it holds (contracts/work.py): the only ones it may pull


class Registry(msgspec.Struct, kw_only=True):
    service_hash: str
    join_hash: str = ""  # empty: no cluster token, nobody can join
    members: dict[str, Member] = {}
    revoked: list[str] = []  # node ids refused if they ask to join again
    version: int = 0  # raised by the leading scheduler at each change: heads take a registry only if it is newer


def node_user(node_id: str, kind: str = "node") -> str:
    return f"{kind}-{node_id}"


def node_inbox(node_id: str) -> str:
    """The inbox prefix a node's connection uses; only it may subscribe there."""
    return f"_N.{node_id}"


def new_password() -> str:
    return secrets.token_urlsafe(32)


def hash_password(password: str) -> str:
    import bcrypt

    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_COST)).decode()


def node_permissions(node_id: str, work: list[str] | tuple[str, ...] = ()) -> dict:
    """The publish and subscribe rights of node (or pod) `node_id`, which holds the models whose `WORK`
    consumers are `work`."""
    kv, kv_stream = ASSIGNMENTS.name, f"KV_{ASSIGNMENTS.name}"
    publish = [
        f"coderai.hb.{node_id}",
        f"coderai.evt.model.loaded.{node_id}",
        f"coderai.evt.model.fetch.{node_id}",  # progress of weights fetched by a model's source
        f"coderai.evt.work.part.{node_id}",
        f"coderai.train.report.*.{node_id}",
        f"coderai.train.upload.*.{node_id}",
        "coderai.reply.*.*",  # answers to fan-out parts, at the random reply subject the part carries
        "coderai.cmd.store.fetch",  # model files from the head's store
        "coderai.cmd.store.list",
        "$JS.API.INFO",
        # its own assignment, read and watched by key
        f"$JS.API.STREAM.INFO.{kv_stream}",
        f"$JS.API.DIRECT.GET.{kv_stream}.$KV.{kv}.{node_id}",
        f"$JS.API.CONSUMER.CREATE.{kv_stream}.*.$KV.{kv}.{node_id}",
        f"$JS.API.CONSUMER.DELETE.{kv_stream}.*",
        f"$JS.API.CONSUMER.INFO.{kv_stream}.*",
        # blobs only through the gateway's blob service, by their random names (runtime/blobs.py BlobProxy)
        "coderai.cmd.blob.read",
        "coderai.cmd.blob.write",
        # fan-out parts: bind the shared durable pull consumers of the models it holds, and pull from them
        f"$JS.API.STREAM.INFO.{WORK.name}",
    ]
    for c in work:  # `work-<model key>-<op>` (contracts/work.py), created only with its own filter subject
        mk, op = c.removeprefix("work-").rsplit("-", 1)
        publish += [f"$JS.API.CONSUMER.INFO.{WORK.name}.{c}", f"$JS.API.CONSUMER.CREATE.{WORK.name}.{c}.coderai.work.{mk}.{op}",
                    f"$JS.API.CONSUMER.MSG.NEXT.{WORK.name}.{c}"]
    subscribe = [f"coderai.engine.{node_id}.>", f"coderai.cmd.node.{node_id}.>", f"{node_inbox(node_id)}.>"]
    return {
        "publish": {"allow": publish},
        "subscribe": {"allow": subscribe},
        "allow_responses": {"max": 1_000_000, "expires": RESPONSE_WINDOW},
    }


def join_permissions() -> dict:
    return {"publish": {"allow": list(JOIN_SUBJECTS)}, "subscribe": {"allow": [f"{JOIN_INBOX}.>"]}}


def render(reg: Registry, now: float | None = None) -> str:
    """nats-server's `authorization` block for the registry (members whose time is up are left out)."""
    now = time.time() if now is None else now
    users: list[dict] = [{"user": SERVICE_USER, "password": reg.service_hash}]
    if reg.join_hash:
        users.append({"user": JOIN_USER, "password": reg.join_hash, "permissions": join_permissions()})
    for m in sorted(reg.members.values(), key=lambda m: m.node_id):
        if m.expires_at and m.expires_at <= now:
            continue
        users.append({"user": node_user(m.node_id, m.kind), "password": m.password_hash,
                      "permissions": node_permissions(m.node_id, m.work)})
    # nats-server's config accepts JSON values, so json.dumps quotes every string safely
    return "authorization {\n  users = " + json.dumps(users, indent=2) + "\n}\n"


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def file_lock(path: Path):
    """Hold an exclusive lock beside the registry while reading, changing and saving it (the scheduler's
    membership and a test harness may both edit it)."""
    import fcntl

    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def load(path: Path) -> Registry | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=Registry)
    except FileNotFoundError:
        return None


def save(path: Path, reg: Registry) -> None:
    _write_private(path, msgspec.json.encode(reg).decode())


def write_users(path: Path, reg: Registry) -> None:
    """The file nats-server reads its users from (`-c`), rewritten whole; SIGHUP makes the server read it again."""
    _write_private(path, render(reg))


def new_registry(join_token: str = "") -> tuple[Registry, str]:
    """A registry with a fresh service password (returned, to be kept by the head) and, with a cluster token,
    the join user."""
    from coderai.runtime.cluster import join_password

    password = new_password()
    return Registry(service_hash=hash_password(password), join_hash=hash_password(join_password(join_token)) if join_token else ""), password


def add_node(reg: Registry, node_id: str, kind: str = "node") -> str:
    """Make `node_id` a member with a new password, returned (for the head's own worker, which needs no join)."""
    password = new_password()
    reg.members[node_id] = Member(node_id=node_id, kind=kind, password_hash=hash_password(password), joined_at=time.time())
    return password


def ensure_registry(folder: Path, secret: Path, token: str = "") -> tuple[Registry, str]:
    """The head's registry in `folder`/members.json, kept across restarts (joined nodes stay members), made on first
    run with a fresh service password (kept in `secret`, mode 0600); its join user follows `token` (none without
    one). Returns it with the service password; the caller saves it and writes the users (`write_users`)."""
    reg_path = folder / "members.json"
    reg = load(reg_path)
    if reg is None or not secret.exists():
        fresh, password = new_registry()
        reg = fresh if reg is None else Registry(service_hash=fresh.service_hash, members=reg.members, revoked=reg.revoked)
        _write_private(secret, password + "\n")
    reg.join_hash = new_registry(token)[0].join_hash if token else ""
    return reg, read_secret(secret)


def read_secret(path: Path) -> str:
    return path.read_text().strip()


def write_secret(path: Path, value: str) -> None:
    """`value` in `path`, mode 0600 (its folder 0700)."""
    _write_private(path, value + "\n")


def ensure_secret(path: Path) -> str:
    """A random secret kept in `path` (mode 0600), made on first use."""
    if path.exists():
        return read_secret(path)
    value = new_password()
    _write_private(path, value + "\n")
    return value
