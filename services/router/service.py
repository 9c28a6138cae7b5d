"""Router lifecycle: keep the engine table from heartbeats, answer `coderai.route.pick`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from coderai.contracts import BusError, Heartbeat, RouteRequest, decode
from coderai.contracts.subjects import HEARTBEAT, ROUTE_PICK
from coderai.contracts.topology import AFFINITY
from coderai.router.picking import EngineTable, pick
from coderai.router.settings import RouterSettings
from coderai.runtime.bus import Bus

log = logging.getLogger("coderai.router")


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.table = EngineTable(ttl_s=settings.engine_ttl_s)
        self.bus: Bus | None = None

    async def start(self, stack: contextlib.AsyncExitStack, stop: asyncio.Event) -> None:
        self.bus = await Bus.connect(self.settings.nats_url, "router")
        stack.push_async_callback(self.bus.close)
        await self.bus.kv(AFFINITY)  # created here; prefix routing fills it
        hb_sub = await self.bus.nc.subscribe(HEARTBEAT.wildcard(), cb=self._on_heartbeat)
        stack.push_async_callback(hb_sub.unsubscribe)
        pick_sub = await self.bus.serve(ROUTE_PICK, self._on_pick, queue="router")
        stack.push_async_callback(pick_sub.unsubscribe)

    async def _on_heartbeat(self, m: Any) -> None:
        try:
            hb = decode(m.data, Heartbeat)
        except Exception as exc:  # noqa: BLE001 - a bad heartbeat from one node must not stop the router
            log.warning("bad heartbeat on %s: %s", m.subject, exc)
            return
        self.table.apply(hb, time.monotonic())

    async def _on_pick(self, req: RouteRequest, _m: Any):
        for gone in self.table.expire(time.monotonic()):
            log.info("node %s went silent; no longer routing to it", gone)
        decision = pick(self.table, req)
        if decision is None:
            raise BusError("no_engine", f"no live engine serves {req.op} for model {req.model!r}", retryable=True)
        return decision


def make(settings: RouterSettings):
    return Router(settings).start
