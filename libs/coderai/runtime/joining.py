"""Joining a cluster: prove the token to the head (and have it prove the token back), get a NATS user of this
node's own, keep its password in the data dir. The token is never sent anywhere; the password never leaves
this machine (the head gets its bcrypt hash)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from pathlib import Path

from coderai.contracts import BusError
from coderai.contracts.admin import JoinHello, JoinProof
from coderai.contracts.subjects import JOIN_HELLO, JOIN_PROVE
from coderai.runtime import members
from coderai.runtime.bus import Bus
from coderai.runtime.tls import client_context, fingerprint
from coderai.runtime.cluster import (
    JOIN_USER,
    head_proof,
    join_password,
    member_proof,
    node_proof,
    nonce,
    same,
    welcome_proof,
    with_user,
    without_user,
)

log = logging.getLogger("coderai.engine_worker")


class JoinRefused(Exception):
    """The head refused us, or is not a head of our cluster."""


def creds_path(data_dir: str) -> Path:
    return Path(os.path.expanduser(data_dir)) / "node-credentials.json"


def saved_url(data_dir: str, url: str, node_id: str) -> tuple[str, str]:
    """(the URL with this node's saved credentials, the CA it pinned) for the head at `url` (by host and port),
    else ("", ""). With several heads, the URL lists the others too (comma-separated, `url` first): the
    connection then reaches a live one when the head it joined is down."""
    try:
        saved = json.loads(creds_path(data_dir).read_text())
    except (OSError, ValueError):
        return "", ""
    if saved.get("head") != without_user(url) or saved.get("node_id") != node_id:
        return "", ""
    others = [h for h in saved.get("heads", []) if h != without_user(url)]
    return ",".join([with_user(url, saved["user"], saved["password"]), *others]), saved.get("ca_pem", "")


def remember_head(data_dir: str, node_id: str, url: str) -> bool:
    """Add `url` to the heads this node's saved credentials list, when its connection with them reached a head
    that the list lacks (one that joined the cluster after this node, or that a short welcome left out): TLS with
    the pinned CA proved it a head of this cluster. Whether the list changed."""
    try:
        saved = json.loads(creds_path(data_dir).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(saved, dict) or saved.get("node_id") != node_id or not saved.get("head"):
        return False
    known = [h for h in saved.get("heads", []) if isinstance(h, str)] or [saved["head"]]
    if url in known:
        return False
    _save(data_dir, {**saved, "heads": [*known, url]})
    log.info("this node reached head %s, which its saved list of heads lacked: added", url)
    return True


_SALT = re.compile(r"^\$2[aby]\$(0[4-9]|1[0-2])\$[./A-Za-z0-9]{22}$")  # a cost the worker can afford to recompute


def held_passwords(data_dir: str, node_id: str) -> list[tuple[str, str]]:
    """The credentials this node saved ((password, its bcrypt hash or '' in files older than the hash), whichever
    head they were saved for): the one of its last join, and the one of a join whose welcome it never got (the
    head may hold either). What proves the node's identity when it joins again."""
    try:
        saved = json.loads(creds_path(data_dir).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(saved, dict) or saved.get("node_id") != node_id:
        return []
    out = [
        (str(c.get("password", "")), str(c.get("password_hash", "")))
        for c in (saved, saved.get("pending") or {})
        if isinstance(c, dict)
    ]
    return [c for c in out if c[0]]


def held_proof(
    held: list[tuple[str, str]], salt: str, node_id: str, worker_nonce: str, head_nonce: str, password_hash: str
) -> str:
    """The proof that this node holds the credential the head keeps for its id (`salt` is that hash's), or ''."""
    import bcrypt

    if not held or not _SALT.match(salt):
        return ""
    # the credential whose hash has that salt; a file older than the saved hash has only one to try
    password = next((pw for pw, h in held if h[:29] == salt), next((pw for pw, h in held if not h), ""))
    if not password:
        return ""
    current = bcrypt.hashpw(password.encode(), salt.encode()).decode()
    return member_proof(current, node_id, worker_nonce, head_nonce, password_hash)


def _save(data_dir: str, creds: dict) -> None:
    path = creds_path(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(creds, fh)
    os.replace(tmp, path)


def forget(data_dir: str) -> None:
    creds_path(data_dir).unlink(missing_ok=True)


async def _first_contact(url: str, name: str, inbox: str, timeout_s: float) -> Bus:
    """The join user's connection: TLS (any certificate: the token authenticates what the head says), else plain
    text for a head without TLS (one on loopback), which learns only the join password: it only asks to join."""
    deadline = time.monotonic() + timeout_s
    while True:
        for tls in (client_context(), None):
            try:
                return await Bus.connect(url, name, connect_timeout_s=min(3.0, timeout_s), inbox_prefix=inbox, tls=tls)
            except BusError:
                if time.monotonic() > deadline:
                    raise


async def join(
    url: str, token: str, node_id: str, data_dir: str, timeout_s: float = 30.0, wait_s: float = 300.0
) -> tuple[str, str]:
    """Join the head at `url`; (the URL with this node's own credentials, the CA to pin: '' without TLS), saved
    for the next start. The first contact takes any certificate: the token authenticates the answers, and the
    CA the head seals in its welcome is the only one trusted from then on. An id that is already a member joins
    only by proving the credential saved in `data_dir` at its last join."""
    held = held_passwords(data_dir, node_id)
    password = members.new_password()
    password_hash = members.hash_password(password)
    mine = nonce()
    join_url, inbox = with_user(url, JOIN_USER, join_password(token)), f"{members.JOIN_INBOX}.{nonce()}"
    bus = await _first_contact(join_url, f"join:{node_id}", inbox, timeout_s)
    try:
        deadline = time.monotonic() + wait_s
        while True:  # a head that is still starting has nobody answering joins yet: ask again until it does
            try:
                challenge = await bus.request(JOIN_HELLO, JoinHello(node_id=node_id, nonce=mine), timeout=10)
                break
            except BusError as exc:
                if not exc.retryable or time.monotonic() > deadline:
                    raise
                if time.monotonic() + wait_s - 1.5 < deadline:  # said once, on the first refusal
                    log.info("the head does not answer joins yet (%s); asking again", exc.message)
                await asyncio.sleep(1.0)
        if not same(challenge.proof, head_proof(token, node_id, mine, challenge.nonce)):
            raise JoinRefused(f"{without_user(url)} answered the join without knowing the cluster token: not our head")
        proof = node_proof(token, node_id, mine, challenge.nonce, password_hash)
        mine_too = held_proof(held, challenge.member_salt, node_id, mine, challenge.nonce, password_hash)
        if challenge.member_salt and not mine_too:
            log.warning("%s is a member of this cluster, and this node holds no credential of it to prove", node_id)
        try:  # the head may take this password and its welcome never arrive: kept, the next join can prove it
            saved = json.loads(creds_path(data_dir).read_text())
        except (OSError, ValueError):
            saved = {}
        if not isinstance(saved, dict) or saved.get("node_id") != node_id:
            saved = {"node_id": node_id}
        _save(data_dir, {**saved, "pending": {"password": password, "password_hash": password_hash}})
        welcome = await bus.request(
            JOIN_PROVE,
            JoinProof(
                node_id=node_id,
                nonce=mine,
                head_nonce=challenge.nonce,
                password_hash=password_hash,
                proof=proof,
                member_proof=mine_too,
            ),
            timeout=10,
        )
    except BusError as exc:
        raise JoinRefused(f"the head refused the join: {exc.message}") from None
    finally:
        await bus.close()
    if not same(welcome.proof, welcome_proof(token, node_id, challenge.nonce, welcome.user, welcome.tls_fingerprint)):
        raise JoinRefused("the head's welcome is not sealed with the cluster token")
    if welcome.tls_fingerprint and not same(fingerprint(welcome.ca_pem), welcome.tls_fingerprint):
        raise JoinRefused("the head's CA does not match the fingerprint it sealed")
    _save(
        data_dir,
        {
            "head": without_user(url),
            "node_id": node_id,
            "user": welcome.user,
            "password": password,
            "password_hash": password_hash,
            "tls_fingerprint": welcome.tls_fingerprint,
            "ca_pem": welcome.ca_pem,
            "heads": welcome.heads,
        },
    )
    log.info(
        "joined the cluster at %s as %s%s",
        without_user(url),
        welcome.user,
        f"; pinned its CA {welcome.tls_fingerprint[:16]}" if welcome.tls_fingerprint else "",
    )
    return with_user(url, welcome.user, password), welcome.ca_pem
