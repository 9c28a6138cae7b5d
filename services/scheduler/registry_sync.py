"""One member registry for every head: the leading scheduler publishes it to the replicated `coderai_members`
bucket besides writing its own head's files, and every head's scheduler process (standbys too) follows that key,
writing its head's `members.json` and `users.conf` and reloading its nats-server when they differ. So a node that
joined through one head logs in at any head, and a revocation or a pod's expiry at one cuts it off at all.

The bucket is the truth of membership (nodes, pods, revocations) once it holds one: a scheduler that starts leading
takes the bucket's members over its own files (which may be stale: a head that was partitioned), and publishes its
files only into an empty bucket (the first head, or one upgraded from a single head). The service, per-service
(`svc-*`) and join logins are each head's own configuration and are never taken from the bucket: a head started
without a cluster token lets nobody join, whatever another head's registry says. Every head accepts every head's
services all the same (a service reconnects to any head when its own dies) because a head that joins by invite
takes the first head's service passwords with it (heads.py `Invite`), so every head holds the same hashes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from nats.js.errors import KeyNotFoundError

from coderai.contracts.topology import MEMBERS
from coderai.runtime import members
from coderai.runtime.bus import Bus
from coderai.runtime.mirror import KVMirror

if TYPE_CHECKING:
    from coderai.scheduler.settings import SchedulerSettings

log = logging.getLogger("coderai.scheduler.membership")

REGISTRY_KEY = "registry"


class HeadFiles:
    """This head's copy of the registry: the file the scheduler reads and nats-server's users file, and the
    nats-server to reload when they change."""

    def __init__(self, members_file: str | Path, users_file: str | Path, pid_file: str | Path | None) -> None:
        self.members_file = Path(members_file).expanduser()
        self.users_file = Path(users_file).expanduser()
        self.pid_file = Path(pid_file).expanduser() if pid_file else None

    def write(self, reg: members.Registry, newer_only: bool = True) -> bool:
        """Make this head's files hold `reg`'s members and revocations, and reload nats-server; False when they
        already did, or (`newer_only`) when this head's registry is as new or newer: the echo of a change this head
        made itself must not undo the one it made next. The service, per-service and join logins stay this head's own:
        they are its configuration (the join user follows the cluster token it was started with), not membership."""
        from coderai.scheduler.membership import reload_nats

        with members.file_lock(self.members_file):
            local = members.load(self.members_file)
            if local is not None:
                if newer_only and reg.version <= local.version:
                    return False
                reg = msgspec.structs.replace(
                    reg, service_hash=local.service_hash, services=local.services, join_hash=local.join_hash
                )
            if local == reg:
                return False
            members.save(self.members_file, reg)
            members.write_users(self.users_file, reg)
        reload_nats(self.pid_file)
        return True


class Publisher:
    """The leader's side: the newest registry, put into the bucket by one task, in order, tried again while the
    bus is away (a change made during a NATS restart still reaches the other heads)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._latest: members.Registry | None = None
        self._wake = asyncio.Event()

    async def adopt(self, files: HeadFiles) -> None:
        """At the start of a term: the bucket's registry written to this head's files when it is newer, else this
        head's registry published (into an empty bucket, or over an older one)."""
        kv = await self.bus.kv(MEMBERS)
        entry = None
        with contextlib.suppress(KeyNotFoundError):
            entry = await kv.get(REGISTRY_KEY)
        theirs = msgspec.json.decode(entry.value, type=members.Registry) if entry is not None and entry.value else None
        local = members.load(files.members_file)
        if theirs is not None and (local is None or theirs.version > local.version):
            if files.write(theirs):
                log.info("took the cluster's member registry (%d members) over this head's", len(theirs.members))
            return
        if local is not None and (theirs is None or _membership(local) != _membership(theirs)):
            if theirs is not None and local.version <= theirs.version:  # changed here, outside any term: newer now
                with members.file_lock(files.members_file):
                    local = members.load(files.members_file)
                    if local is None:  # the file went away since: nothing of this head's to publish
                        return
                    local.version = theirs.version + 1
                    members.save(files.members_file, local)
            await kv.put(REGISTRY_KEY, msgspec.json.encode(local))

    def publish(self, reg: members.Registry) -> None:
        self._latest = reg
        self._wake.set()

    async def run(self) -> None:
        wait = 0.25
        while True:
            await self._wake.wait()
            self._wake.clear()
            reg = self._latest
            if reg is None:
                continue
            try:
                await (await self.bus.kv(MEMBERS)).put(REGISTRY_KEY, msgspec.json.encode(reg))
                wait = 0.25
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the bus is away: the newest registry goes once it is back
                log.warning("member registry not published (%s); trying again in %.1fs", exc, wait)
                if self._latest is reg:
                    self._wake.set()
                await asyncio.sleep(wait)
                wait = min(wait * 2, 5.0)


def _membership(reg: members.Registry) -> tuple:
    return reg.members, reg.revoked


class Follower:
    """Every head's side: this head's files follow the bucket's registry."""

    def __init__(self, bus: Bus, files: HeadFiles) -> None:
        self.files = files
        self.mirror: KVMirror = KVMirror(bus, MEMBERS, members.Registry, on_change=self._changed)
        self.applied = 0  # registries written to this head's files

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        await self.mirror.bind()
        self.mirror.start()
        stack.callback(self.mirror.stop)

    def restart(self) -> None:
        """After a reconnect: the watch goes on from the last revision it saw."""
        self.mirror.start()

    def _changed(self, key: str, reg: members.Registry | None) -> None:
        if key != REGISTRY_KEY or reg is None:
            return
        try:
            if self.files.write(reg):
                self.applied += 1
                log.info("member registry updated from the cluster: %d members", len(reg.members))
        except Exception as exc:  # a nats-server not running yet reads the file when it starts
            log.warning("member registry written, nats-server not reloaded: %s", exc)


async def follow(settings: SchedulerSettings, stack: contextlib.AsyncExitStack) -> Follower:
    """This head's files following the cluster's registry, on a connection of their own (a standby scheduler
    holds none), for as long as `stack` is open."""
    follower: Follower | None = None

    async def reconnected() -> None:
        if follower is not None:
            follower.restart()

    bus = await Bus.connect_as(settings, "scheduler-registry", on_reconnect=reconnected)
    stack.push_async_callback(bus.close)
    follower = Follower(bus, HeadFiles(settings.members_file, settings.nats_users_file, settings.nats_pid_file or None))
    await follower.start(stack)
    return follower
