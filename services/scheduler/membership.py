"""Membership: who may log in to the head's NATS. Joins (the token's challenge, both ways), revocations and the
short-lived credentials of rented pods; each change rewrites nats-server's users and reloads it (SIGHUP), which
also disconnects a removed member at once. Runs in the scheduler on the head, beside the nats-server it owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig
from coderai import heads
from coderai.contracts import BusError
from coderai.contracts.admin import (
    JoinChallenge,
    JoinHello,
    JoinProof,
    JoinWelcome,
    MemberInfo,
    MembersReply,
    MembersRequest,
    PodUser,
    PodUserRequest,
    RevokeRequest,
)
from coderai.contracts.subjects import (
    CMD_SCHEDULER_MEMBERS,
    CMD_SCHEDULER_POD_USER,
    CMD_SCHEDULER_REVOKE,
    JOIN_HELLO,
    JOIN_PROVE,
    check_token,
)
from coderai.contracts.topology import WORK
from coderai.contracts.work import consumer_config, work_consumers
from coderai.runtime import members
from coderai.runtime.cluster import head_proof, member_proof, node_proof, nonce, same, welcome_proof
from coderai.runtime.bus import Bus
from coderai.runtime.tls import fingerprint
from coderai.scheduler.registry_sync import HeadFiles, Publisher

log = logging.getLogger("coderai.scheduler.membership")

CHALLENGE_TTL_S = 30.0
MAX_PENDING = 1024
_BCRYPT = re.compile(r"^\$2[aby]\$\d{2}\$[./A-Za-z0-9]{53}$")


class Membership:
    """The member registry of this head and the handlers that change it."""

    def __init__(
        self,
        bus: Bus,
        token: str,
        members_file: str,
        auth_file: str,
        pid_file: str,
        ca_pem: str = "",
        on_revoke: Callable[[str], None] | None = None,
    ) -> None:
        self.bus = bus
        self.token = token
        self.members_file = Path(os.path.expanduser(members_file))
        self.auth_file = Path(os.path.expanduser(auth_file))
        self.pid_file = Path(os.path.expanduser(pid_file)) if pid_file else None
        self.ca_pem = ca_pem  # NATS' CA, handed to joining workers to pin (sealed by its fingerprint)
        self.tls_fingerprint = fingerprint(ca_pem) if ca_pem else ""
        self.on_revoke = on_revoke
        self.pending: dict[str, tuple[str, str, float]] = {}  # head nonce -> (node id, worker nonce, deadline)
        self._lock = asyncio.Lock()
        self.files = HeadFiles(self.members_file, self.auth_file, self.pid_file)
        self.publisher = Publisher(bus)  # every change also to the other heads (registry_sync.py)
        self._head_urls: list[str] = []  # the last list of heads read for a welcome
        self.made: set[str] = set()  # the `WORK` consumers this scheduler made (make_consumers)

    def registry(self) -> members.Registry:
        reg = members.load(self.members_file)
        if reg is None:
            raise BusError("unavailable", f"no member registry at {self.members_file}", retryable=False)
        return reg

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        async with self._lock:
            await self.publisher.adopt(self.files)  # the cluster's registry, which may be newer than this head's
        self.registry()  # fail at start, not at the first join, when the head was not set up for members
        publish = asyncio.create_task(self.publisher.run(), name="registry-publisher")
        stack.callback(publish.cancel)
        handlers = [
            (CMD_SCHEDULER_MEMBERS, self._list),
            (CMD_SCHEDULER_REVOKE, self._revoke),
            (CMD_SCHEDULER_POD_USER, self._pod_user),
        ]
        if self.token:
            handlers += [(JOIN_HELLO, self._hello), (JOIN_PROVE, self._prove)]
        for subject, handler in handlers:
            sub = await self.bus.serve(subject, handler, queue="membership")
            stack.push_async_callback(sub.unsubscribe)
        sweep = asyncio.create_task(self._sweep_loop())
        stack.callback(sweep.cancel)
        log.info(
            "membership: %d member(s); joins %s",
            len(self.registry().members),
            "on" if self.token else "off (no cluster token)",
        )

    # --- the join handshake ----------------------------------------------------------------------

    async def _hello(self, req: JoinHello, _m: Msg) -> JoinChallenge:
        node_id = _node_id(req.node_id)
        if len(req.nonce) < 16:
            raise BusError("bad_request", "the join nonce is too short", retryable=False)
        now = time.monotonic()
        self.pending = {k: v for k, v in self.pending.items() if v[2] > now}
        while len(self.pending) >= MAX_PENDING:
            self.pending.pop(next(iter(self.pending)))
        head_nonce = nonce()
        self.pending[head_nonce] = (node_id, req.nonce, now + CHALLENGE_TTL_S)
        held = self.registry().members.get(node_id)  # a member must prove its credential: tell it which one
        salt = held.password_hash[:29] if held is not None and held.kind == "node" else ""
        return JoinChallenge(
            nonce=head_nonce, proof=head_proof(self.token, node_id, req.nonce, head_nonce), member_salt=salt
        )

    async def _prove(self, req: JoinProof, _m: Msg) -> JoinWelcome:
        node_id = _node_id(req.node_id)
        held = self.pending.pop(req.head_nonce, None)  # one answer per challenge: a replay finds nothing
        if held is None or held[2] < time.monotonic() or held[0] != node_id or not same(held[1], req.nonce):
            raise BusError("forbidden", "no such join challenge (expired, or answered already)", retryable=False)
        if not same(req.proof, node_proof(self.token, node_id, req.nonce, req.head_nonce, req.password_hash)):
            log.warning("join of %s refused: it does not know the cluster token", node_id)
            raise BusError(
                "forbidden", "the join proof is wrong: this worker has another cluster token", retryable=False
            )
        if not _BCRYPT.match(req.password_hash):
            raise BusError("bad_request", "password_hash must be a bcrypt hash", retryable=False)
        async with self._lock:
            with members.file_lock(self.members_file):
                reg = self.registry()
                if node_id in reg.revoked:
                    log.warning("join of revoked node %s refused", node_id)
                    raise BusError(
                        "forbidden",
                        f"node {node_id} was revoked; `coderai nodes revoke {node_id} --forget` lets it join again",
                        retryable=False,
                    )
                old = reg.members.get(node_id)
                if old is not None and old.kind != "node":
                    raise BusError("forbidden", f"{node_id} is a pod's id", retryable=False)
                if old is not None and not (
                    req.member_proof
                    and same(
                        req.member_proof,
                        member_proof(old.password_hash, node_id, req.nonce, req.head_nonce, req.password_hash),
                    )
                ):
                    # the token lets one ask to join, not take an identity that is held: only the holder of the
                    # member's credential (its own data dir) replaces it, or the operator forgets the id first
                    log.warning(
                        "join under member %s's id refused: it does not prove that member's credential", node_id
                    )
                    raise BusError(
                        "forbidden",
                        f"{node_id} is already a member, and this join does not prove its "
                        "credential (the one in that node's node-credentials.json); if the "
                        f"machine lost it, `coderai nodes revoke {node_id} --forget` on the "
                        "head re-admits the id",
                        retryable=False,
                    )
                reg.members[node_id] = members.Member(
                    node_id=node_id, password_hash=req.password_hash, joined_at=time.time()
                )
                self._apply(reg)
        log.info("node %s joined", node_id)
        user = members.node_user(node_id)
        # every head the bucket lists and this head's own file names (a read through a consumer can come back
        # short on a busy head, and a head invited from here is in the file before it is in the bucket): a worker
        # whose welcome named fewer could not reach the others once the head it joined died
        on_file = heads.urls(heads.load(self.members_file.parent.parent))
        try:  # the heads bucket's keys are listed through a consumer: seconds on a busy head
            read = self._head_urls = await asyncio.wait_for(heads.client_urls(self.bus), 5)
        except Exception as exc:  # the list read last
            read = self._head_urls
            log.info(
                "heads not read for %s's welcome (%s); told the last read and this head's heads file",
                node_id,
                str(exc) or type(exc).__name__,
            )
        urls = list(dict.fromkeys([*read, *on_file])) if read or len(on_file) > 1 else []
        return JoinWelcome(
            user=user,
            tls_fingerprint=self.tls_fingerprint,
            ca_pem=self.ca_pem,
            heads=urls,
            proof=welcome_proof(self.token, node_id, req.head_nonce, user, self.tls_fingerprint),
        )

    # --- operator commands and the pod-broker ----------------------------------------------------

    async def _list(self, _req: MembersRequest, _m: Msg) -> MembersReply:
        return _reply(self.registry())

    async def _revoke(self, req: RevokeRequest, _m: Msg) -> MembersReply:
        node_id = _node_id(req.node_id)
        async with self._lock:
            with members.file_lock(self.members_file):
                reg = self.registry()
                gone = reg.members.pop(node_id, None)
                if req.forget:
                    reg.revoked = [n for n in reg.revoked if n != node_id]
                elif node_id not in reg.revoked:
                    reg.revoked.append(node_id)
                self._apply(reg)
        log.info(
            "node %s %s",
            node_id,
            "revoked"
            if gone
            else "was not a member; its id is refused from now on"
            if not req.forget
            else "may join again",
        )
        if gone is not None and self.on_revoke is not None:
            self.on_revoke(node_id)
        return _reply(reg)

    async def _pod_user(self, req: PodUserRequest, _m: Msg) -> PodUser:
        node_id = _node_id(req.pod_id)
        password = members.new_password()
        expires = time.time() + max(60.0, req.ttl_s)
        await self.make_consumers(work_consumers(req.models))
        async with self._lock:
            with members.file_lock(self.members_file):
                reg = self.registry()
                old = reg.members.get(node_id)
                if old is not None and old.kind != "pod":
                    raise BusError("forbidden", f"{node_id} is a node's id", retryable=False)
                reg.members[node_id] = members.Member(
                    node_id=node_id,
                    kind="pod",
                    password_hash=members.hash_password(password),
                    joined_at=time.time(),
                    expires_at=expires,
                    work=work_consumers(req.models),
                )
                self._apply(reg)
        return PodUser(user=members.node_user(node_id, "pod"), password=password, expires_at=expires)

    async def make_consumers(self, consumers: list[str]) -> None:
        """Make each shared `WORK` consumer with its one config (`consumer_config`), or set it back to it: nodes may
        only bind them. Each is made once per scheduler run (and again after a reconnect)."""
        for c in consumers:
            if c in self.made:
                continue
            try:
                config = consumer_config(c)
                assert isinstance(config, ConsumerConfig)  # typed `object` there: the contracts never import nats
                await self.bus.js.add_consumer(WORK.name, config=config)
            except Exception as exc:  # made at the next grant; until then its holders wait for it
                log.warning("cannot make the work consumer %s: %s", c, exc)
                continue
            self.made.add(c)

    async def grant_work(self, node_id: str, models: list) -> None:
        """Let `node_id` pull the fan-out parts of exactly `models` (what it is assigned), before it is told to."""
        want = work_consumers(models)
        await self.make_consumers(want)
        async with self._lock:
            with members.file_lock(self.members_file):
                reg = self.registry()
                m = reg.members.get(node_id)
                if m is None or m.work == want:
                    return
                m.work = want
                self._apply(reg)

    async def _sweep_loop(self) -> None:
        """Pods' credentials end with their time: drop the expired ones from the config."""
        while True:
            await asyncio.sleep(30)
            with contextlib.suppress(BusError, OSError):
                await self.sweep()

    async def sweep(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        async with self._lock:
            with members.file_lock(self.members_file):
                reg = self.registry()
                expired = [n for n, m in reg.members.items() if m.expires_at and m.expires_at <= now]
                for n in expired:
                    del reg.members[n]
                if expired:
                    self._apply(reg)
                    log.info("pod credentials expired: %s", ", ".join(expired))
        return expired

    # --- nats-server -----------------------------------------------------------------------------

    def _apply(self, reg: members.Registry) -> None:
        """Save the registry, rewrite the users and have nats-server reload them; then every other head's."""
        reg.version += 1  # newer than every registry any head holds: the others take it, none undoes it
        members.save(self.members_file, reg)
        members.write_users(self.auth_file, reg)
        reload_nats(self.pid_file)
        self.publisher.publish(reg)


def reload_nats(pid_file: Path | None) -> None:
    if pid_file is None:
        raise BusError(
            "unavailable", "this head does not know nats-server's pid file: members cannot change", retryable=False
        )
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, signal.SIGHUP)
    except (OSError, ValueError) as exc:
        raise BusError(
            "unavailable", f"cannot reload nats-server (pid file {pid_file}): {exc}", retryable=True
        ) from None


def _node_id(value: str) -> str:
    try:
        check_token(value, "node id")
    except ValueError as exc:
        raise BusError("bad_request", str(exc), retryable=False) from None
    if len(value) > 128 or not re.fullmatch(r"[A-Za-z0-9_-]+", value):
        raise BusError("bad_request", "a node id is 1-128 letters, digits, '-' or '_'", retryable=False)
    return value


def _reply(reg: members.Registry) -> MembersReply:
    return MembersReply(
        members=[
            MemberInfo(node_id=m.node_id, kind=m.kind, joined_at=m.joined_at, expires_at=m.expires_at, addr=m.addr)
            for m in sorted(reg.members.values(), key=lambda m: m.node_id)
        ],
        revoked=list(reg.revoked),
    )
