"""The router's pick made in the gateway's own process, off the bus (docs/performance.md: the pick's request and
reply were 2 of the 4 messages in sequence before a first token, and the router's CPU and nats-server's share).

The gateway keeps its own copy of what the router picks from, fed as the router's is: the engine table from the
nodes' heartbeats (judged against the scheduler's assignments and the pods' leases), the models, and the affinity
bucket (`Router.follow`, the same code). It picks with the same function and settings (`CODERAI_ROUTER_*`), writes
where a conversation went to the same bucket, and counts the requests it routed as they finish.

It only answers when it can: while its copy is not whole and current (the gateway just started, the bus
reconnected, a bucket is being read again), or when it finds no engine for the model, the router is asked over
the bus as before. So a stale copy can cost a round trip, never a wrong `no_engine`: the router's answer, and the
scheduler's escalation after it, stay the authority on "nothing serves this model"."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from coderai.contracts import BusError, RouteDecision, RouteRequest
from coderai.router.service import Router
from coderai.router.settings import RouterSettings
from coderai.runtime.bus import Bus
from coderai.runtime.settings import load_settings

log = logging.getLogger("coderai.gateway")

RETRY_S = 5.0
"""How long a copy that could not start (JetStream not ready) waits before trying again; the bus answers meanwhile."""


class Picker:
    """A gateway process's copy of the router (`Router(embedded=True)`), picking locally when its view is whole."""

    def __init__(self, bus: Bus, settings: RouterSettings | None = None) -> None:
        self.bus = bus
        self.router = Router(settings or load_settings(RouterSettings, "router"), embedded=True)
        self.local = 0  # picks answered here
        self.asked = 0  # picks this process sent to the router instead
        self._stack = contextlib.AsyncExitStack()
        self._task: asyncio.Task | None = None
        self.following = False

    def start(self) -> None:
        """Follow in the background: the gateway serves at once, asking the router until the copy is whole."""
        self._task = asyncio.create_task(self._follow(), name="route-copy")

    async def _follow(self) -> None:
        while True:
            try:
                await self.router.follow(self.bus, self._stack, sync_wait_s=0)
                self.following = True
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._stack.aclose()
                self._stack = contextlib.AsyncExitStack()
                log.info("routing copy not started (%s); the router is asked meanwhile", exc)
                await asyncio.sleep(RETRY_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self._stack.aclose()

    def on_reconnect(self) -> None:
        """The bus came back: the mirrors' watches start again (a restarted server may have dropped them); the
        copy is not current until they have caught up, and the router is asked meanwhile."""
        if self.following:
            for mirror in self._mirrors():
                mirror.start()

    def _mirrors(self):
        r = self.router
        return (r.models, r.affinity, r.assignments, r.pods)

    @property
    def ready(self) -> bool:
        """Whole and current: every mirror read and following its bucket, and the engine table fed (a node's
        heartbeat, or the nodes' records at the start)."""
        return self.following and all(m.current.is_set() for m in self._mirrors()) and bool(self.router.table.node_seen)

    def pick(self, req: RouteRequest, headers: dict[str, str] | None = None) -> RouteDecision | None:
        """The engine for `req` from this copy; None when the router must be asked (the copy is not ready, or it
        knows no engine for the model). A pin that names an engine that is down is the router's to refuse too."""
        if not self.ready:
            return None
        try:
            decision = self.router.pick(req, headers, kind="internal")
        except BusError as exc:
            if exc.code != "no_engine":
                raise
            return None
        self.local += 1
        return decision

    def completed(self, engine_id: str) -> None:
        """A request this gateway sent to `engine_id` finished: its load goes down until the next heartbeat."""
        if engine_id:
            self.router.table.completed(engine_id)
