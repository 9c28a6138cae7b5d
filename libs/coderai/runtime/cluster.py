"""One cluster token, typed the same on every machine, and what is derived from it. Pure; no I/O.

The token itself never leaves the machine: mDNS carries only a fingerprint, and NATS only sees passwords
derived per role, so a stranger on the LAN learns nothing it could join with.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from urllib.parse import quote, urlsplit, urlunsplit

MEMBERSHIP_CONTEXT = b"coderai-cluster-membership-v1"
ROLES = ("service", "node")

# What a node (a worker on another machine) may do on the bus: heartbeat, answer jobs, publish events, and
# follow its own assignment through the JetStream KV API. Everything else is the services' (role "service").
NODE_PUBLISH = [
    "coderai.hb.*",
    "coderai.evt.>",
    "_INBOX.>",  # frames and replies go to callers' inboxes
    "coderai.cmd.store.fetch",  # model files from the head's store
    "coderai.cmd.store.list",  # the files of a model folder there
    "coderai.train.>",  # fine-tuning: progress reports, and rank 0's adapter upload into the head's store
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.KV_coderai_assignments",
    "$JS.API.CONSUMER.CREATE.KV_coderai_assignments",
    "$JS.API.CONSUMER.CREATE.KV_coderai_assignments.>",
    "$JS.API.CONSUMER.DELETE.KV_coderai_assignments.>",
    "$JS.API.CONSUMER.INFO.KV_coderai_assignments.>",
    "$JS.API.DIRECT.GET.KV_coderai_assignments.>",
    "$JS.API.STREAM.MSG.GET.KV_coderai_assignments",
    "$JS.FC.>",
    # uploads in and results out through the `coderai_blobs` object store (the gateway creates the bucket)
    "$O.coderai_blobs.>",
    "$JS.API.STREAM.INFO.OBJ_coderai_blobs",
    "$JS.API.STREAM.NAMES",  # nats-py looks the stream up by subject when it reads an object
    "$JS.API.CONSUMER.CREATE.OBJ_coderai_blobs",
    "$JS.API.CONSUMER.CREATE.OBJ_coderai_blobs.>",
    "$JS.API.CONSUMER.DELETE.OBJ_coderai_blobs.>",
    "$JS.API.DIRECT.GET.OBJ_coderai_blobs.>",
    "$JS.API.STREAM.MSG.GET.OBJ_coderai_blobs",
    "$JS.API.STREAM.PURGE.OBJ_coderai_blobs",
    # fan-out parts: bind the shared durable pull consumer of the WORK stream, pull, ack
    "$JS.API.STREAM.INFO.WORK",
    "$JS.API.CONSUMER.CREATE.WORK",
    "$JS.API.CONSUMER.CREATE.WORK.>",
    "$JS.API.CONSUMER.DURABLE.CREATE.WORK.>",
    "$JS.API.CONSUMER.INFO.WORK.>",
    "$JS.API.CONSUMER.MSG.NEXT.WORK.>",
    "$JS.ACK.WORK.>",
]
NODE_SUBSCRIBE = ["coderai.engine.>", "coderai.cmd.node.>", "coderai.work.>", "_INBOX.>"]


def fingerprint(token: str) -> str:
    """What mDNS announces: 24 hex digits of HMAC-SHA256(token, membership context)."""
    return hmac.new(token.encode(), MEMBERSHIP_CONTEXT, hashlib.sha256).hexdigest()[:24]


def credentials(token: str, role: str) -> tuple[str, str]:
    """(user, password) for NATS; one pair per role, derived so every machine computes the same."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    password = hmac.new(token.encode(), f"coderai-nats-{role}-v1".encode(), hashlib.sha256).hexdigest()
    return role, password


def with_credentials(url: str, token: str, role: str) -> str:
    """`nats://host:port` with this role's user and password in it (an empty token leaves the URL alone)."""
    if not token:
        return url
    user, password = credentials(token, role)
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(user)}:{quote(password)}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme or "nats", netloc, parts.path, parts.query, parts.fragment))


def nats_auth_config(token: str) -> str:
    """The `authorization` block of nats-server's config: full rights for services, worker subjects for nodes."""
    users = []
    for role in ROLES:
        user, password = credentials(token, role)
        entry = {"user": user, "password": password}
        if role == "node":
            entry["permissions"] = {"publish": {"allow": NODE_PUBLISH}, "subscribe": {"allow": NODE_SUBSCRIBE}}
        users.append(entry)
    # nats-server's config accepts JSON values, so json.dumps quotes every string safely
    return "authorization {\n  users = " + json.dumps(users, indent=2) + "\n}\n"
