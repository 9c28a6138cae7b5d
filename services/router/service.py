"""Router lifecycle: the engine table from heartbeats, model pins and affinity from KV mirrors, and
`coderai.route.pick` answered from memory; affinity writes happen after the reply, off the request path."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from typing import Any

from nats.aio.msg import Msg
from coderai.contracts import (
    BusError,
    EngineReady,
    Heartbeat,
    ModelConfig,
    RequestCompleted,
    RouteDecision,
    RouteRequest,
    decode,
    encode,
    model_key,
)
from coderai.contracts.nodes import Assignment, EngineStatus
from coderai.contracts.pods import LIVE_POD, PodInfo
from coderai.contracts.routing import AffinityEntry
from coderai.contracts.subjects import EVT_ENGINE_READY, EVT_REQUEST_COMPLETED, HEARTBEAT, ROUTE_PICK
from coderai.contracts.topology import AFFINITY, ASSIGNMENTS, MODELS, NODES, PODS
from coderai.router.picking import (
    AFFINITY_TTL_S,
    ERROR_CAP,
    EngineTable,
    LoadGuard,
    RoundRobin,
    evicted_keys,
    keys_to_record,
    pick,
)
from coderai.router.settings import RouterSettings
from coderai.runtime import tracing
from coderai.runtime.bus import Bus
from coderai.runtime.kv import read_all
from coderai.runtime.leader import Fence
from coderai.runtime.mirror import KVMirror

log = logging.getLogger("coderai.router")

REMEMBERED = 10_000
"""Faults logged once each; past this many distinct ones the memory starts afresh (a few repeats, no flood)."""
PICKS_KEPT = 65_536
"""Requests this router picked an engine for and has not yet seen finish; past this many the oldest is forgotten
(a request whose `request.completed` was lost would otherwise be kept for ever)."""


class Router:
    def __init__(self, settings: RouterSettings, embedded: bool = False) -> None:
        self.settings = settings
        # embedded: a gateway's own copy, picking in its process (coderai.gateway.picker). The router service
        # announces engines and logs what nodes do wrong; a copy in every gateway would say it all again
        self.embedded = embedded
        self.table = EngineTable(ttl_s=settings.engine_ttl_s)
        self.guard = LoadGuard(settings.guard_ratio, settings.guard_slack)
        self.round_robin = RoundRobin()
        self.models_by_name: dict[str, ModelConfig] = {}
        self.bus: Bus | None = None
        self._background: set[asyncio.Task] = set()
        self._latest: dict[str, AffinityEntry] = {}
        self._writing: set[str] = set()
        self.placed: dict[str, frozenset[str]] = {}  # node id -> models its assignment (or its pod's lease) gives it
        # node id -> the newest scheduler token seen on its assignments, and the assignment that token's leader
        # wrote: one from a former leader that woke up late is ignored here as the node itself ignores it
        self.fences: dict[str, Fence] = {}
        self.accepted: dict[str, Assignment] = {}
        self._logged: set[tuple[str, ...]] = set()
        # request id -> the engine this router picked for it, until its `request.completed`: only these finish
        # against the load it counted (a gateway that picked in its own copy counts its own requests there)
        self._picked: dict[str, str] = {}
        self.forgotten = 0  # affinity keys dropped because their engine's cache no longer holds them

    async def start(self, stack: contextlib.AsyncExitStack, stop: asyncio.Event) -> None:
        self.bus = await Bus.connect_as(self.settings, "router", on_reconnect=self._on_reconnect)
        stack.push_async_callback(self.bus.close)
        await self.follow(self.bus, stack)
        done_sub = await self.bus.listen(EVT_REQUEST_COMPLETED, self._on_completed)
        stack.push_async_callback(done_sub.unsubscribe)
        pick_sub = await self.bus.serve(ROUTE_PICK, self._on_pick, queue="router")
        stack.push_async_callback(pick_sub.unsubscribe)
        log.info("routing with policy %s; %d affinity entries", self.settings.policy, len(self.affinity.values))

    async def follow(self, bus: Bus, stack: contextlib.AsyncExitStack, sync_wait_s: float = 10.0) -> None:
        """Keep the engine table and the mirrors current on `bus`: the models, affinity, assignments and pods
        buckets, the nodes' last recorded heartbeats, then every heartbeat. What a pick is made from. Waits up to
        `sync_wait_s` for the mirrors' first reading (`synced`)."""
        self.bus = bus
        self.models = KVMirror(self.bus, MODELS, ModelConfig, on_change=self._model_changed)
        self.affinity = KVMirror(
            self.bus, AFFINITY, AffinityEntry, max_entries=self.settings.affinity_max_entries, shrink=_shared_ids
        )
        self.assignments = KVMirror(self.bus, ASSIGNMENTS, Assignment, on_change=self._placement_changed)
        self.pods = KVMirror(self.bus, PODS, PodInfo, on_change=self._placement_changed)
        mirrors = (self.models, self.affinity, self.assignments, self.pods)
        for mirror in mirrors:
            await mirror.bind()
            mirror.start()
            stack.callback(mirror.stop)
        try:  # a restarted router answers with the affinity it had, not from scratch
            await asyncio.wait_for(asyncio.gather(*(m.synced.wait() for m in mirrors)), sync_wait_s)
        except asyncio.TimeoutError:
            if sync_wait_s:
                log.warning("KV mirrors not synced within %g s; serving with what has arrived", sync_wait_s)
        await self._seed_engines()
        prune = asyncio.create_task(self._prune_loop())
        stack.callback(prune.cancel)
        hb_sub = await self.bus.listen(HEARTBEAT, self._on_heartbeat)
        stack.push_async_callback(hb_sub.unsubscribe)

    @property
    def _bus(self) -> Bus:
        """The bus `start` connected (heartbeats and announcements come only after)."""
        if self.bus is None:
            raise RuntimeError("the router is not started: no bus yet")
        return self.bus

    async def _seed_engines(self) -> None:
        """Start from the last heartbeats the scheduler recorded in `coderai_nodes` (at most a TTL old), so a
        restarted router routes at once instead of answering "no engine" until the next heartbeats arrive."""
        records = await read_all(await self._bus.kv(NODES), Heartbeat)
        now = time.monotonic()
        for key, hb in records.items():
            try:
                self._apply(hb, now)
            except Exception as exc:  # one bad record must not stop the start
                log.warning("ignoring node record %s: %s", key, exc)

    async def _on_reconnect(self) -> None:
        for mirror in (self.models, self.affinity, self.assignments, self.pods):
            mirror.start()

    def _model_changed(self, key: str, cfg: ModelConfig | None) -> None:
        self.models_by_name = {m.name: m for m in self.models.values.values()}

    def _placement_changed(self, node_id: str, _value: Any) -> None:
        """An assignment or a pod changed: the node's models again, and its last heartbeat judged by them (so an
        engine given a moment before its heartbeat came counts at once, and one taken away stops at once)."""
        models: set[str] = set()
        assignment = self.assignments.values.get(node_id)
        if assignment is None:
            self.accepted.pop(node_id, None)
        elif self.fences.setdefault(node_id, Fence()).admits(assignment.fence):
            self.accepted[node_id] = assignment
        else:
            log.warning(
                "ignoring %s's assignment from a former leader (token %d, newest %d)",
                node_id,
                assignment.fence,
                self.fences[node_id].newest,
            )
        if (kept := self.accepted.get(node_id)) is not None:
            models.update(m.name for m in kept.models)
        pod = self.pods.values.get(node_id)
        if pod is not None and pod.state in LIVE_POD:
            models.add(pod.model)
        placed = frozenset(models)
        if self.placed.get(node_id) == placed:
            return
        if placed:
            self.placed[node_id] = placed
        else:
            self.placed.pop(node_id, None)
        hb = self.table.heartbeats.get(node_id)
        if hb is not None:
            before = self.table.on_node(node_id)
            self._faults(hb, self.table.reapply(node_id, placed))
            self._announce(node_id, before)

    def _apply(self, hb: Heartbeat, now: float) -> None:
        before = self.table.on_node(hb.node_id)
        self._faults(hb, self.table.apply(hb, now, self.placed.get(hb.node_id, frozenset())))
        self._announce(hb.node_id, before)
        # one deleter (the copies see the deletes through their watch), and only when an engine says it lost some
        if not self.embedded and any(e.evicted for e in hb.engines):
            for key in evicted_keys(hb, self.table, self.affinity.values):
                self._forget(key)

    def _forget(self, key: str) -> None:
        """Delete the key's affinity entry, unless it was written since (a revision-checked delete): its engine's
        cache no longer holds the conversation."""
        rev = self.affinity.revisions.get(key, 0)
        self.affinity.forget(key)
        self.forgotten += 1
        if rev and key not in self._writing:
            self._spawn(self._delete(key, rev))

    def _spawn(self, work: Any) -> None:
        """Run `work` off the path that asked for it, kept referenced until it ends."""
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _delete(self, key: str, rev: int) -> None:
        try:
            await self.affinity.kv.delete(key, last=rev)
        except Exception as exc:  # written again meanwhile (that entry stands), or the bus is away
            log.debug("affinity delete for %s not done: %s", key, exc)

    def _announce(self, node_id: str, before: set[str]) -> None:
        """`EngineReady` for each engine of `node_id` this router routes to now and did not `before`: requests
        waiting for a load on demand or a pod (the gateway's escalation) ask again at once."""
        if self.bus is None or self.embedded:
            return
        for v in [v for v in self.table.engines.values() if v.node_id == node_id and v.engine_id not in before]:
            self._spawn(
                self._publish_ready(EngineReady(model=v.model, engine_id=v.engine_id, node_id=node_id, ts=time.time()))
            )

    async def _publish_ready(self, e: EngineReady) -> None:
        try:
            await self._bus.publish(EVT_ENGINE_READY, e, model_key=model_key(e.model))
        except Exception as exc:  # the bus may be reconnecting: a waiting request asks again later anyway
            log.debug("could not announce engine %s: %s", e.engine_id, exc)

    def _faults(self, hb: Heartbeat, refused: list[tuple[EngineStatus, str]]) -> None:
        """Log, once each, what a node claimed beyond what it was given (a node fault) and why its engines failed
        (under the reference a tenant's 503 names; the node's text capped)."""
        if self.embedded:
            return
        for e, why in refused:
            self._once(
                ("claim", hb.node_id, e.engine_id, e.model), "node fault: node %s claims %s; ignored", hb.node_id, why
            )
        for e in hb.engines:
            if e.state == "failed" and e.engine_id in self.table.failed:
                node, model, ref = self.table.failed[e.engine_id]
                if node == hb.node_id:
                    self._once(
                        ("failed", ref),
                        "engine %s of node %s (model %s) failed [fault %s]: %s",
                        e.engine_id,
                        node,
                        model,
                        ref,
                        (e.error or "no reason given")[:ERROR_CAP],
                    )

    def _once(self, what: tuple[str, ...], msg: str, *args: Any) -> None:
        if what in self._logged:
            return
        if len(self._logged) >= REMEMBERED:
            self._logged.clear()
        self._logged.add(what)
        log.warning(msg, *args)

    async def _on_heartbeat(self, hb: Heartbeat, _m: Msg) -> None:
        self._apply(hb, time.monotonic())

    async def _on_completed(self, e: RequestCompleted, _m: Msg) -> None:
        """One of this router's picks finished: its engine's load goes down until the next heartbeat. Every other
        request (most of them: gateways pick in their own copies) was never counted here, so it is not taken off:
        that would read an engine busy with other gateways' requests as idle."""
        engine = self._picked.pop(e.request_id, None)
        if engine is not None:
            self.table.completed(engine)

    async def _on_pick(self, req: RouteRequest, m: Msg) -> RouteDecision:
        decision = self.pick(req, m.headers)
        self._picked.pop(req.request_id, None)  # a failover's second pick: the request is the newest again
        self._picked[req.request_id] = decision.engine_id
        if len(self._picked) > PICKS_KEPT:
            del self._picked[next(iter(self._picked))]
        return decision

    def pick(self, req: RouteRequest, headers: dict[str, str] | None, kind: str = "server") -> RouteDecision:
        """`req`'s engine, in a `router.pick` span under the asker's (`headers`) while tracing is on: a span of
        the router's when asked over the bus, of the gateway's when its copy picks (`kind` "internal")."""
        if not tracing.enabled():
            return self._pick(req)
        with tracing.start_span(
            "router.pick",
            headers=headers,
            kind=kind,
            attributes={
                "coderai.request_id": req.request_id,
                "coderai.model": req.model,
                "coderai.op": req.op,
            },
        ) as span:
            decision = self._pick(req)
            span.set_attributes({"coderai.route_reason": decision.reason, "coderai.engine_id": decision.engine_id})
            return decision

    def _pick(self, req: RouteRequest) -> RouteDecision:
        for gone in self.table.expire(time.monotonic()):
            log.log(
                logging.DEBUG if self.embedded else logging.INFO, "node %s went silent; no longer routing to it", gone
            )
        for failed in req.exclude:
            self.table.suspect(failed)
        policy = self.settings.policy
        if policy == "round_robin":
            decision = self.round_robin.pick(self.table, req)
        else:
            affinity = self.affinity.values if policy == "prefix" else None
            decision = pick(self.table, req, affinity, self.models_by_name.get(req.model), time.time(), self.guard)
        if decision is None:  # failed engines by reference only: their text is their node's, not ours to show
            refs = self.table.failures(req.model)
            raise BusError(
                "no_engine",
                f"no live engine serves {req.op} for model {req.model!r}"
                + (f" ({len(refs)} failed to load; the operator can look up fault {', '.join(refs)})" if refs else ""),
                retryable=True,
            )
        if policy == "prefix":
            self._record(req, decision)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "picked %s for %s (%s)",
                decision.engine_id,
                req.model,
                decision.reason,
                extra={"request_id": req.request_id},
            )
        return decision

    # --- affinity writes --------------------------------------------------------------------------

    def _record(self, req: RouteRequest, d: RouteDecision) -> None:
        """Remember where this conversation went; unchanged entries are rewritten only to slide their TTL."""
        now = time.time()
        for key in keys_to_record(req):
            cur = self.affinity.values.get(key)
            if cur is not None and cur.engine_id == d.engine_id and now - cur.ts < self.settings.affinity_refresh_s:
                continue
            entry = AffinityEntry(engine_id=d.engine_id, node_id=d.node_id, ts=now)
            self.affinity.put(key, entry)  # this router's next pick sees it before the watch echoes it
            self._latest[key] = entry
            if key not in self._writing:  # one writer per key, so this router's own decisions land in order
                self._writing.add(key)
                self._spawn(self._writer(key))

    async def _writer(self, key: str) -> None:
        """Write the newest decision for `key`, revision-checked. Losing to another router means re-reading:
        its entry stands unless this router has decided again since, in which case ours goes on top."""
        kv = self.affinity.kv
        try:
            while True:
                entry = self._latest[key]
                rev = self.affinity.revisions.get(key, 0)
                try:
                    new_rev = await (kv.update(key, encode(entry), last=rev) if rev else kv.create(key, encode(entry)))
                    self.affinity.remember(key, entry, new_rev)
                except Exception as exc:  # lost a race (or the bus is down): adopt the winner
                    try:
                        theirs = await kv.get(key)
                        self.affinity.remember(key, decode(theirs.value, AffinityEntry), theirs.revision)
                    except Exception:  # nothing to adopt; the watch corrects the local guess
                        log.debug("affinity write for %s failed: %s", key, exc)
                        self._latest.pop(key, None)
                        return
                if self._latest.get(key) is entry:
                    del self._latest[key]
                    return
        finally:
            self._writing.discard(key)

    async def _prune_loop(self) -> None:
        """Drop expired entries from memory (the bucket's TTL drops them from the server)."""
        evicted = 0
        while True:
            await asyncio.sleep(60)
            now = time.time()
            for key in [k for k, e in self.affinity.values.items() if now - e.ts > AFFINITY_TTL_S]:
                self.affinity.forget(key)
            if self.affinity.evicted != evicted:
                log.info(
                    "affinity: %d entries in memory, %d oldest dropped for the bound (%d) in the last minute",
                    len(self.affinity.values),
                    self.affinity.evicted - evicted,
                    self.affinity.max_entries,
                )
                evicted = self.affinity.evicted


def _shared_ids(e: AffinityEntry) -> AffinityEntry:
    """An entry whose engine and node ids are the one copy of each string (a third of an entry's bytes)."""
    return AffinityEntry(engine_id=sys.intern(e.engine_id), node_id=sys.intern(e.node_id), ts=e.ts)


def make(settings: RouterSettings):
    return Router(settings).start
