"""Several heads, kept for their importers (the gateway, the scheduler, the test helpers) and the `coderai heads`
command: the records and the invite are `coderai.stack.heads`, a head's place among the others (the `coderai_heads`
bucket, replicas, sentinels) is `coderai.stack.ha`, and `coderai heads invite` is `coderai.stack.invite`."""

from __future__ import annotations

from coderai.stack.ha import (
    Keeper,
    announce,
    client_urls,
    known,
    raise_replicas,
    sentinel_for,
    sentinel_master,
    set_quorum,
    take_place,
)
from coderai.stack.heads import (
    HEADS_FILE,
    INVITE_TTL_S,
    NATS_PORT,
    REDIS_MASTER_NAME,
    REDIS_PORT,
    ROUTE_PORT,
    SENTINEL_PORT,
    Head,
    Invite,
    head_certificate,
    install,
    load,
    merge,
    replicas,
    save,
    sentinel_quorum,
    sentinel_url,
    urls,
)
from coderai.stack.invite import invite_main, main

__all__ = [
    "HEADS_FILE",
    "INVITE_TTL_S",
    "NATS_PORT",
    "REDIS_MASTER_NAME",
    "REDIS_PORT",
    "ROUTE_PORT",
    "SENTINEL_PORT",
    "Head",
    "Invite",
    "Keeper",
    "announce",
    "client_urls",
    "head_certificate",
    "install",
    "invite_main",
    "known",
    "load",
    "main",
    "merge",
    "raise_replicas",
    "replicas",
    "save",
    "sentinel_for",
    "sentinel_master",
    "sentinel_quorum",
    "sentinel_url",
    "set_quorum",
    "take_place",
    "urls",
]
