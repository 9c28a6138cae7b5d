"""Who may log in to the head's NATS, and with which rights: the member registry and the `authorization` block
of nats-server's config rendered from it.

Every login belongs to one identity. Each head service logs in as its own user (`svc-gateway`, `svc-router`,
`svc-scheduler`, `svc-pod-broker`, `svc-metrics`, see `SERVICE_ROLES`) with its own random password made on the
head's first start, and may use only the subjects, streams and buckets it needs (`service_permissions`), so one
compromised service is not the whole bus. User `service` keeps every right for what needs the whole bus: the
operator's CLI and a head's own bootstrap (heads.py). Each node (a worker on any machine, this box's own
included) and each rented pod logs in as `node-<id>` / `pod-<id>` with a password only it knows: the registry
keeps a bcrypt hash. User `join` may only ask to join (its password comes from the cluster token, and it reaches nothing else). The head adds and removes
members by rewriting the config and sending nats-server SIGHUP, which also disconnects a removed member at once.

A node's rights are the least it needs (docs/security.md lists them): its own heartbeat, engine, command and
inbox subjects, replies only to requests it was sent (`allow_responses`), its own assignment key, events and
training reports under its own id, and blobs only through the gateway's blob service, by their random names.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import time
from pathlib import Path

import msgspec

from coderai.contracts.topology import (
    AFFINITY,
    ASSIGNMENTS,
    BATCH_LINES,
    BATCHES,
    BLOBS,
    EVENTS,
    FILES,
    FINETUNE,
    HEADS,
    KEYS,
    LEADERS,
    MODELS,
    NODES,
    POD_LEDGER,
    PODS,
    RESPONSES,
    VIDEOS,
    WORK,
    BucketSpec,
)
from coderai.runtime.cluster import JOIN_USER

SERVICE_USER = "service"
"""Every right on the bus, for what truly needs it: the operator's CLI (`coderai nodes`, `keys`, `heads invite`, ...:
an operator may do anything) and a head's own bootstrap (heads.py `take_place` and `Keeper`, which list and raise
every stream and write `coderai_heads`). No service logs in as it."""
SERVICE_ROLES = ("gateway", "router", "scheduler", "pod-broker", "metrics")
"""The head's services, each with a NATS user of its own (`service_user`)."""
FULL_RIGHTS_ROLES = ("scheduler",)
"""Services that keep every right under their own user. The scheduler admits members: it answers joins, makes
pods' users and writes the users file nats-server reads (and the `coderai_members` registry every head follows),
so any allow-list it had would be one it could lift itself; it also drives every node (`coderai.cmd.node.>`),
serves the model store and owns most buckets. Its own user still keeps its password apart from the others'."""
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
    services: dict[str, str] = {}  # each head service's own user: role -> bcrypt hash (SERVICE_ROLES)
    join_hash: str = ""  # empty: no cluster token, nobody can join
    members: dict[str, Member] = {}
    revoked: list[str] = []  # node ids refused if they ask to join again
    version: int = 0  # raised by the leading scheduler at each change: heads take a registry only if it is newer


def node_user(node_id: str, kind: str = "node") -> str:
    return f"{kind}-{node_id}"


def node_inbox(node_id: str) -> str:
    """The inbox prefix a node's connection uses; only it may subscribe there."""
    return f"_N.{node_id}"


def requester(reply: str) -> str | None:
    """Who sent a bus request, read from its reply subject, which decides who can read the answer: a node's or
    pod's connection answers into its own inbox (`_N.<id>.`, the only inbox its rights let it subscribe to): "<id>";
    a service's into `_INBOX.` or its own `_S.<role>.`: "". Anything else (a node asking for the answer on a subject
    it may subscribe to, such as its own `coderai.engine.<id>.x`, or no reply at all) is None: not a requester
    anything is served to."""
    parts = reply.split(".")
    if len(parts) > 2 and parts[0] == "_N" and parts[1]:
        return parts[1]
    if len(parts) > 1 and parts[0] == "_INBOX":
        return ""
    if len(parts) > 2 and parts[0] == "_S" and parts[1] in SERVICE_ROLES:  # a service's own inbox (service_inbox)
        return ""
    return None


def service_user(role: str) -> str:
    """The NATS user of head service `role` (one of SERVICE_ROLES)."""
    return f"svc-{role}"


def service_role(user: str) -> str:
    """The role a service user logs in as (`svc-router` -> `router`), else ''."""
    role = user.removeprefix("svc-")
    return role if role != user and role in SERVICE_ROLES else ""


def service_inbox(role: str) -> str:
    """The inbox prefix of service `role`'s connections: only that role may subscribe there, so no other service
    reads its replies (a gateway's are the tenants' answers)."""
    return f"_S.{role}"


def service_secret(role: str) -> str:
    """The file name, under `<data>/secrets/`, of service `role`'s NATS password."""
    return f"nats-svc-{role}.password"


def file_user(name: str) -> str:
    """The service user whose password file is named `name` (`service_secret`), else ''."""
    role = name.removeprefix("nats-svc-").removesuffix(".password")
    return service_user(role) if role in SERVICE_ROLES and name == service_secret(role) else ""


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
        # answers to what the gateways and the scheduler sent it (an engine job's frames, a command's reply), at
        # their inboxes' random subjects: outright, as `allow_responses` alone is not enough: nats-server forgets
        # those grants at every users reload (each join, revocation, pod), and a streamed answer was cut there.
        # It may not subscribe there, and a subject it was not sent is a random one nobody reads
        f"{service_inbox('gateway')}.>",
        f"{service_inbox('scheduler')}.>",
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
        # fan-out parts: bind the shared durable pull consumers of the models it holds, and pull from them; the
        # scheduler makes them (contracts/work.py consumer_config): a node may not make one or change its settings
        f"$JS.API.STREAM.INFO.{WORK.name}",
    ]
    for c in work:  # `work-<model key>-<op>` (contracts/work.py); its acks outright, as its answers (above)
        publish += [
            f"$JS.API.CONSUMER.INFO.{WORK.name}.{c}",
            f"$JS.API.CONSUMER.MSG.NEXT.{WORK.name}.{c}",
            f"$JS.ACK.{WORK.name}.{c}.>",
        ]
    subscribe = [f"coderai.engine.{node_id}.>", f"coderai.cmd.node.{node_id}.>", f"{node_inbox(node_id)}.>"]
    return {
        "publish": {"allow": publish},
        "subscribe": {"allow": subscribe},
        "allow_responses": {"max": 1_000_000, "expires": RESPONSE_WINDOW},
    }


def _stream_read(stream: str) -> list[str]:
    """Bind a stream (made if missing), read its messages by subject and through consumers of its own (KV watches
    and key listings, object store reads, a durable pull consumer)."""
    api = "$JS.API"
    return [
        f"{api}.STREAM.INFO.{stream}",
        f"{api}.STREAM.CREATE.{stream}",
        f"{api}.STREAM.MSG.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}.>",
        f"{api}.CONSUMER.CREATE.{stream}",
        f"{api}.CONSUMER.CREATE.{stream}.>",
        f"{api}.CONSUMER.DURABLE.CREATE.{stream}.>",
        f"{api}.CONSUMER.INFO.{stream}.>",
        f"{api}.CONSUMER.DELETE.{stream}.>",
        f"{api}.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]  # flow control of its watches, granted outright (see `_REPLIES_TO`)


def _manage(stream: str) -> list[str]:
    """Change a stream it writes: raise its replicas (stores.fit_replicas) and purge (object store deletes)."""
    return [f"$JS.API.STREAM.UPDATE.{stream}", f"$JS.API.STREAM.PURGE.{stream}"]


def _kv_read(spec: BucketSpec) -> list[str]:
    return _stream_read(f"KV_{spec.name}")


def _kv_write(spec: BucketSpec, keys: str = ">") -> list[str]:
    return _kv_read(spec) + _manage(f"KV_{spec.name}") + [f"$KV.{spec.name}.{keys}"]


def _objects(spec: BucketSpec) -> list[str]:
    # nats-py reads an object through a consumer on its chunks' subject without naming the stream, so the client
    # first asks which stream holds that subject (STREAM.NAMES: the names of streams, nothing in them)
    return (
        _stream_read(f"OBJ_{spec.name}")
        + _manage(f"OBJ_{spec.name}")
        + [f"$O.{spec.name}.>"]
        + ["$JS.API.STREAM.NAMES"]
    )


_REPLIES_TO = {
    "router": ("gateway",),  # route picks
    "pod-broker": ("scheduler", "gateway", ""),  # acquire; status and leases; `coderai pods` (the CLI, `service`)
    "gateway": (),  # nodes' blob reads and writes: `_N.*.>` below
    "metrics": (),
}
"""Whose requests each limited service answers: it may publish into their inboxes outright. `allow_responses`
alone is not enough: nats-server forgets the replies it allowed whenever it reloads its users (each join, revocation
and pod), so an answer to a request received just before a reload was refused (the pod broker's answer to the
scheduler's `acquire` as a pod joined). Publishing into an inbox reaches nothing without the random reply subject,
which only the asker's messages carry."""


def _service_rights(role: str) -> tuple[list[str], list[str]]:
    """(publish, subscribe) allow-lists of a limited service role, besides its inbox and `$JS.API.INFO`.

    Read from each service's code (contracts/subjects.py names the subjects):
    - router: answers `coderai.route.pick`, follows heartbeats and `request.completed` (plain subscriptions, not
      the stream), reads the nodes, assignments, models and pods buckets and writes only `coderai_affinity`;
      announces engines it can route to now (`coderai.evt.engine.ready.<model>`).
    - metrics: follows heartbeats and the model/part events; reads `request.completed` through its durable
      consumer on EVENTS; reads the pods, models and leaders buckets; writes only its own lease key (the EVENTS
      consumer's leader). It publishes nothing else.
    - pod-broker: answers `coderai.cmd.broker.>`, follows heartbeats, asks the scheduler for pods' users and their
      revocation, publishes pod events; writes `coderai_pods`, the pod ledger's journal and its own lease key.
    - gateway: asks the router, the scheduler (the commands its API maps to), the pod broker (status, leases) and
      nodes (admin logs and drain); sends jobs to every engine and fan-out parts to WORK; publishes
      `request.completed`; serves nodes' blob reads and writes; follows the routers' `engine.ready` (a request
      waiting for a model to load or a pod to start asks again then); takes handed-out replies; reads nodes, models,
      leaders and heads (`/admin/nodes` names every head's URL); writes the buckets and object stores of what
      tenants keep (keys journal, files, responses, batches, videos, fine-tuning records, blobs). Its copy of the
      router's view (gateway/picker.py) follows heartbeats, reads the assignments and pods buckets and writes
      `coderai_affinity`, as the router does. WORK: only its consumers' info (how many holders pull a model), never a
      consumer of its own (a work queue's consumer that acked would take parts from the nodes)."""
    if role == "router":
        publish = (
            _kv_write(AFFINITY)
            + [r for b in (NODES, ASSIGNMENTS, MODELS, PODS) for r in _kv_read(b)]
            + ["coderai.evt.engine.ready.*"]
        )
        return publish, ["coderai.hb.*", "coderai.evt.request.completed", "coderai.route.pick"]
    if role == "metrics":
        publish = (
            _stream_read(EVENTS.name)
            + _kv_write(LEADERS, "metrics")
            + _kv_read(PODS)
            + _kv_read(MODELS)
            + [f"$JS.ACK.{EVENTS.name}.metrics.>"]
        )  # its durable consumer's acks (no other consumer's)
        return publish, [
            "coderai.hb.*",
            "coderai.evt.work.part.*",
            "coderai.evt.model.loaded.*",
            "coderai.evt.model.unloaded",
        ]
    if role == "pod-broker":
        publish = (
            ["coderai.cmd.scheduler.pod_user", "coderai.cmd.scheduler.revoke", "coderai.evt.pod.*"]
            + _kv_write(PODS)
            + _kv_write(POD_LEDGER)
            + _kv_write(LEADERS, "pod-broker")
            + _kv_read(MODELS)
        )
        return publish, ["coderai.cmd.broker.>", "coderai.hb.*"]
    if role == "gateway":
        scheduler = ("escalate", "nodes", "place", "add", "remove", "stages", "train", "train_cancel")
        publish = (
            [
                "coderai.route.pick",
                "coderai.engine.*.*.*",
                "coderai.work.*.*",
                "coderai.evt.request.completed",
                "coderai.cmd.broker.status",
                "coderai.cmd.broker.lease",
                "coderai.cmd.node.*.logs",
                "coderai.cmd.node.*.drain",
            ]
            + [f"coderai.cmd.scheduler.{verb}" for verb in scheduler]
            + _stream_read(EVENTS.name)
            + [f"$JS.API.STREAM.INFO.{WORK.name}", f"$JS.API.CONSUMER.INFO.{WORK.name}.*"]
            + [r for b in (NODES, MODELS, LEADERS, HEADS, ASSIGNMENTS, PODS) for r in _kv_read(b)]
            + [r for b in (KEYS, VIDEOS, FINETUNE, RESPONSES, BATCHES, BATCH_LINES, AFFINITY) for r in _kv_write(b)]
            + _objects(BLOBS)
            + _objects(FILES)
            + ["_N.*.>"]
        )  # answers to nodes' blob reads and writes (see `_REPLIES_TO`)
        return publish, [
            "coderai.cmd.blob.read",
            "coderai.cmd.blob.write",
            "coderai.reply.>",
            "coderai.evt.engine.ready.*",
            "coderai.hb.*",
        ]
    raise ValueError(f"no allow-list for service {role!r}")


def service_permissions(role: str) -> dict | None:
    """The publish and subscribe rights of head service `role`: None (every right) for FULL_RIGHTS_ROLES, else
    what `_service_rights` lists, its own inbox (`service_inbox`), and answers to requests it was sent
    (`allow_responses`: a reply, an ack of a message its consumer pulled, a flow-control answer) and nothing else."""
    if role in FULL_RIGHTS_ROLES:
        return None
    publish, subscribe = _service_rights(role)
    publish += [f"{service_inbox(asker)}.>" if asker else "_INBOX.>" for asker in _REPLIES_TO.get(role, ())]
    return {
        "publish": {"allow": ["$JS.API.INFO", *dict.fromkeys(publish)]},
        "subscribe": {"allow": [*subscribe, f"{service_inbox(role)}.>"]},
        "allow_responses": {"max": 1_000_000, "expires": RESPONSE_WINDOW},
    }


def manages(role: str, stream: str) -> bool:
    """Whether service `role` may change `stream`'s configuration (raise its replicas): every role but a limited
    one, which may only for the streams it writes ('' is no service role: a full-rights login)."""
    perms = service_permissions(role) if role in SERVICE_ROLES else None
    return perms is None or f"$JS.API.STREAM.UPDATE.{stream}" in perms["publish"]["allow"]


def join_permissions() -> dict:
    return {"publish": {"allow": list(JOIN_SUBJECTS)}, "subscribe": {"allow": [f"{JOIN_INBOX}.>"]}}


def render(reg: Registry, now: float | None = None) -> str:
    """nats-server's `authorization` block for the registry (members whose time is up are left out)."""
    now = time.time() if now is None else now
    users: list[dict] = [{"user": SERVICE_USER, "password": reg.service_hash}]
    for role in SERVICE_ROLES:
        if role in reg.services:
            perms = service_permissions(role)
            users.append(
                {"user": service_user(role), "password": reg.services[role]} | ({"permissions": perms} if perms else {})
            )
    if reg.join_hash:
        users.append({"user": JOIN_USER, "password": reg.join_hash, "permissions": join_permissions()})
    for m in sorted(reg.members.values(), key=lambda m: m.node_id):
        if m.expires_at and m.expires_at <= now:
            continue
        users.append(
            {
                "user": node_user(m.node_id, m.kind),
                "password": m.password_hash,
                "permissions": node_permissions(m.node_id, m.work),
            }
        )
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
    return Registry(
        service_hash=hash_password(password), join_hash=hash_password(join_password(join_token)) if join_token else ""
    ), password


def add_services(reg: Registry, roles: tuple[str, ...] = SERVICE_ROLES) -> dict[str, str]:
    """Give each service in `roles` a new random password (its own, derived from nothing): its hash kept in `reg`,
    the passwords returned by role."""
    passwords = {role: new_password() for role in roles}
    reg.services.update({role: hash_password(pw) for role, pw in passwords.items()})
    return passwords


def ensure_services(reg: Registry, secrets_dir: Path) -> dict[str, str]:
    """Each service's password, kept in `secrets_dir`/`service_secret(role)` (mode 0600), made on first run, and its
    hash in `reg`. A password whose file is gone, or that the registry's hash does not match (a registry from another
    head without its secrets), is made anew. Returns the passwords by role."""
    import bcrypt

    out: dict[str, str] = {}
    for role in SERVICE_ROLES:
        path = secrets_dir / service_secret(role)
        password = read_secret(path) if path.exists() else ""
        known = reg.services.get(role, "")
        if not password or not known or not bcrypt.checkpw(password.encode(), known.encode()):
            password = add_services(reg, (role,))[role]
            _write_private(path, password + "\n")
        out[role] = password
    return out


def add_node(reg: Registry, node_id: str, kind: str = "node") -> str:
    """Make `node_id` a member with a new password, returned (for the head's own worker, which needs no join)."""
    password = new_password()
    reg.members[node_id] = Member(
        node_id=node_id, kind=kind, password_hash=hash_password(password), joined_at=time.time()
    )
    return password


def ensure_registry(folder: Path, secret: Path, token: str = "") -> tuple[Registry, str]:
    """The head's registry in `folder`/members.json, kept across restarts (joined nodes stay members), made on first
    run with a fresh service password (kept in `secret`, mode 0600) and one for each head service (`ensure_services`,
    beside `secret`); its join user follows `token` (none without one). Returns it with the service password; the
    caller saves it and writes the users (`write_users`)."""
    reg_path = folder / "members.json"
    reg = load(reg_path)
    if reg is None or not secret.exists():
        fresh, password = new_registry()
        reg = (
            fresh
            if reg is None
            else Registry(
                service_hash=fresh.service_hash, services=reg.services, members=reg.members, revoked=reg.revoked
            )
        )
        _write_private(secret, password + "\n")
    reg.join_hash = new_registry(token)[0].join_hash if token else ""
    ensure_services(reg, secret.parent)
    return reg, read_secret(secret)


def read_secret(path: Path) -> str:
    return path.read_text().strip()


def write_secret(path: Path, value: str) -> None:
    """`value` in `path`, mode 0600 (its folder 0700)."""
    _write_private(path, value + "\n")


def data_secret(data_dir: str | os.PathLike, name: str) -> str:
    """The secret `<data_dir>/secrets/<name>`, made on first use under a lock: a head's gateway workers start
    together, one makes it and the others read it, so every gateway of the head signs and checks with one key."""
    path = Path(os.path.expanduser(data_dir)) / "secrets" / name
    try:
        with file_lock(path):
            return ensure_secret(path)
    except OSError as exc:  # a read-only folder (compose's secrets volume, whose keys coderai-init made): nobody
        if exc.errno not in (errno.EROFS, errno.EACCES) or not path.exists():  # writes it, so no lock is needed
            raise
        return read_secret(path)


def ensure_secret(path: Path) -> str:
    """A random secret kept in `path` (mode 0600), made on first use."""
    if path.exists():
        return read_secret(path)
    value = new_password()
    _write_private(path, value + "\n")
    return value
