"""mDNS (zeroconf): every worker announces `_coderai._tcp.local.`; a worker given only the cluster token finds the
head by it. Only the token's fingerprint is announced. Liveness never comes from here (a killed announcer stays
in mDNS caches for minutes): heartbeats and the `coderai_nodes` TTL decide who is alive.

Interfaces: the addresses given, else every interface (`InterfaceChoice.All`) in production. Tests always name
their network-namespace addresses, so nothing is announced on a real network.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from coderai import __version__

log = logging.getLogger("coderai.discovery")

SERVICE_TYPE = "_coderai._tcp.local."


@dataclass(frozen=True)
class Announcement:
    node_id: str
    name: str
    fp: str
    nats_port: int = 0  # > 0: this machine's NATS takes nodes (the head)
    caps: tuple[str, ...] = ()

    def properties(self) -> dict[str, str]:
        return {
            "name": self.name,
            "id": self.node_id,
            "ver": __version__,
            "nats": str(self.nats_port or ""),
            "caps": ",".join(self.caps),
            "fp": self.fp,
        }


def _zeroconf(interfaces: list[str]) -> AsyncZeroconf:
    return AsyncZeroconf(
        interfaces=list(interfaces) if interfaces else InterfaceChoice.All, ip_version=IPVersion.V4Only
    )


class Announcer:
    """Registers this node's service record on the given interfaces until `close()`."""

    def __init__(self, ann: Announcement, interfaces: list[str]) -> None:
        self.ann = ann
        self.interfaces = interfaces
        self.azc: AsyncZeroconf | None = None

    async def start(self) -> None:
        self.azc = _zeroconf(self.interfaces)
        info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{self.ann.node_id}.{SERVICE_TYPE}",
            port=self.ann.nats_port or 9,  # a node offers no port; 9 (discard) fills the field
            properties=self.ann.properties(),
            parsed_addresses=list(self.interfaces) or _local_addresses(),
            server=f"{self.ann.node_id}.local.",
        )
        # registering returns a task that must be awaited too, or the announcement may never go out
        await (await self.azc.async_register_service(info, allow_name_change=True))
        log.info("announced %s on mDNS (%s)", self.ann.node_id, ", ".join(self.interfaces) or "all interfaces")

    async def close(self) -> None:
        if self.azc is not None:
            await self.azc.async_unregister_all_services()
            await self.azc.async_close()
            self.azc = None


def _local_addresses() -> list[str]:
    try:
        return sorted(
            {str(ai[4][0]) for ai in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)} - {"127.0.0.1"}
        ) or ["127.0.0.1"]
    except OSError:
        return ["127.0.0.1"]


async def find_head(fp: str, interfaces: list[str], timeout_s: float = 30.0) -> tuple[str, int, str]:
    """Browse until a service with our fingerprint offers NATS; returns (address, port, node id).

    Services with another fingerprint are ignored without a word beyond a debug line: a stranger's cluster is
    not our business, and ours tells them nothing.
    """
    azc = _zeroconf(interfaces)
    found: asyncio.Future = asyncio.get_running_loop().create_future()

    async def inspect(name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(azc.zeroconf, 3000):
            return
        props = {k.decode(): (v or b"").decode() for k, v in (info.properties or {}).items()}
        if props.get("fp") != fp:
            log.debug("ignoring %s: another cluster", name)
            return
        if props.get("nats") and info.parsed_addresses() and not found.done():
            found.set_result((info.parsed_addresses()[0], int(props["nats"]), props.get("id", "")))

    tasks: set[asyncio.Task] = set()

    def on_change(zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            t = asyncio.ensure_future(inspect(name))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    browser = AsyncServiceBrowser(azc.zeroconf, SERVICE_TYPE, handlers=[on_change])
    try:
        return await asyncio.wait_for(found, timeout_s)
    finally:
        await browser.async_cancel()
        await azc.async_close()
