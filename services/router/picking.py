"""Pure routing: which live engine serves this request. No I/O; the service feeds it heartbeats and affinity.

Order: a pin (per request, then per model) beats everything; then the engine that the longest affinity key
points at (session, user, then the prefix chain from its longest element down), unless that engine is dead,
no longer holds the model, was excluded, or is overloaded against the least-busy holder (see `LoadGuard`);
then the least-busy holder, one whose KV cache has room first.

Everything a node says about its engines is its own word: each figure is clamped, and none can make an engine
look less busy than an idle one that says nothing (a negative count is 0, a KV share that is not a number is not
known).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from coderai.contracts import BusError, Heartbeat, ModelConfig, RouteDecision, RouteRequest
from coderai.contracts.nodes import EVICTED_MAX, EngineStatus
from coderai.contracts.routing import AffinityEntry, RouteReason
from coderai.runtime.claims import claim_fault

AFFINITY_TTL_S = 1800.0
MAX_SLOTS = 1024
"""The most requests one engine is believed to run at once, whatever its node says (llama-server's --parallel
and vLLM's batch stay far below): a node claiming 100,000 slots is not thereby the least busy forever."""
MAX_IN_FLIGHT = 65_536
KV_FULL = 0.9
"""An engine whose running requests hold this share of its KV cache takes a new conversation only when every other
holder is as full: the new one would wait for memory (or, on vLLM, push a running one out)."""
ERROR_CAP = 500
"""Characters of a node's `error` text kept for the operator's log; tenants never see the text (see `fault_ref`)."""


def fault_ref(node_id: str, engine_id: str, error: str) -> str:
    """A short reference for a failed engine's error, the same on every router: what a tenant's 503 names in
    place of the node's own text (which the node chose), and what the operator finds in the router's log."""
    return hashlib.sha256(f"{node_id}\0{engine_id}\0{error}".encode()).hexdigest()[:10]


@dataclass
class EngineView:
    """What the router believes about one engine: its last heartbeat, plus picks and completions since."""

    engine_id: str
    node_id: str
    model: str
    ops: frozenset[str]
    in_flight: int
    picks_since_hb: int = 0
    done_since_hb: int = 0
    slots: int = 1  # requests it runs at once (llama-server's --parallel); 1 where the engine reports none
    reported: int = 0  # what the engine's server said it runs and holds waiting (slots_busy + queued)
    kv_used: float = 0.0  # the share of its KV cache its running requests hold, 0..1 (0: not known)

    @property
    def load(self) -> int:
        """In flight now, estimated: the heartbeat's count (up to ~2 s old), or the engine's own count of what it
        runs and queues when that is more (it sees requests the worker's count may miss), plus requests routed
        here since, minus requests that finished here since (from `request.completed` events)."""
        return max(0, max(self.in_flight, self.reported) + self.picks_since_hb - self.done_since_hb)

    @property
    def kv_full(self) -> bool:
        """Its KV cache is nearly full (`KV_FULL`): busy for a new conversation, whatever its slots say."""
        return self.kv_used >= KV_FULL

    @property
    def busy_share(self) -> float:
        """Load per slot: an engine with 8 slots and 4 requests is less busy than one with 1 slot and 1."""
        return self.load / max(1, self.slots)


@dataclass
class EngineTable:
    """Engines by id, rebuilt per node from each heartbeat; a node silent for `ttl_s` is dropped."""

    ttl_s: float = 6.0
    engines: dict[str, EngineView] = field(default_factory=dict)
    node_seen: dict[str, float] = field(default_factory=dict)
    last_pick: dict[str, int] = field(default_factory=dict)  # engine id -> pick sequence, to rotate ties
    picks: int = 0
    failed: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # engine id -> (node, model, fault ref)
    heartbeats: dict[str, Heartbeat] = field(
        default_factory=dict
    )  # each node's last, applied again when its placement changes

    def least_busy(self, candidates: list[EngineView]) -> EngineView:
        """Lowest load per slot among the engines whose KV cache has room (all of them when none has); among equals
        the one picked least recently (never picked first), then the lowest id, so idle engines take new
        conversations in turn instead of all landing on one."""
        return min(candidates, key=lambda v: (v.kv_full, v.busy_share, self.last_pick.get(v.engine_id, 0), v.engine_id))

    def chose(self, v: EngineView) -> None:
        self.picks += 1
        self.last_pick[v.engine_id] = self.picks
        v.picks_since_hb += 1

    def apply(self, hb: Heartbeat, now: float, placed: frozenset[str] | None = None) -> list[tuple[EngineStatus, str]]:
        """Replace this node's engines with the heartbeat's ready ones (its failed ones kept by fault reference).

        A node's word counts only for the engines it was given: with `placed` (the models the scheduler's
        assignment or the pod broker's lease puts on this node), an engine for any other model, or under an id
        that is not that model's on this node, is left out and returned with why (a node fault for the caller
        to log). None: unchecked (a table built by hand). Load figures are clamped to sane bounds (`_view`)."""
        node = hb.node_id
        self.node_seen[node] = now
        self.heartbeats[node] = hb
        self.drop_node(node)
        refused: list[tuple[EngineStatus, str]] = []
        for e in hb.engines:
            why = claim_fault(node, e, placed, self.holder(e.engine_id))
            if why:
                refused.append((e, why))
            elif e.state == "ready":
                self.engines[e.engine_id] = _view(node, e)
            elif e.state == "failed":
                self.failed[e.engine_id] = (node, e.model, fault_ref(node, e.engine_id, e.error or ""))
        return refused

    def on_node(self, node_id: str) -> set[str]:
        """The ids of the node's engines that can be routed to now."""
        return {e for e, v in self.engines.items() if v.node_id == node_id}

    def holder(self, engine_id: str) -> str | None:
        """The node whose engine has this id, ready or failed (None: no node's)."""
        v = self.engines.get(engine_id)
        if v is not None:
            return v.node_id
        f = self.failed.get(engine_id)
        return f[0] if f is not None else None

    def reapply(self, node_id: str, placed: frozenset[str] | None) -> list[tuple[EngineStatus, str]]:
        """The node's last heartbeat judged again after its placement changed (an engine it was just given
        counts at once, one taken away stops at once); its liveness is not renewed."""
        hb = self.heartbeats.get(node_id)
        if hb is None or node_id not in self.node_seen:
            return []
        return self.apply(hb, self.node_seen[node_id], placed)

    def expire(self, now: float) -> list[str]:
        """Forget nodes not heard from within the TTL; returns their ids."""
        gone = [n for n, t in self.node_seen.items() if now - t > self.ttl_s]
        for n in gone:
            del self.node_seen[n]
            self.heartbeats.pop(n, None)
            self.drop_node(n)
        return gone

    def drop_node(self, node_id: str) -> None:
        for eid in [e for e, v in self.engines.items() if v.node_id == node_id]:
            del self.engines[eid]
        for eid in [e for e, f in self.failed.items() if f[0] == node_id]:
            del self.failed[eid]

    def failures(self, model: str) -> list[str]:
        """The fault references of the model's failed engines, for a `no_engine` that says they failed without
        repeating what their nodes said (an operator looks the reference up in the router's log)."""
        return [ref for _, (_, m, ref) in sorted(self.failed.items()) if m == model]

    def suspect(self, engine_id: str) -> None:
        """A gateway saw this engine fail: route around it until its node's next heartbeat vouches for it."""
        self.engines.pop(engine_id, None)

    def completed(self, engine_id: str) -> None:
        """A request on this engine finished (a `request.completed` event)."""
        v = self.engines.get(engine_id)
        if v is not None:
            v.done_since_hb += 1

    def holders(self, model: str, op: str) -> list[EngineView]:
        return [v for v in self.engines.values() if v.model == model and op in v.ops]


def _count(n: int, most: int) -> int:
    return min(max(0, n), most)


def _share(x: float) -> float:
    """A node's fraction, 0..1; NaN is 0 (not known), so a lie can only make its engine look fuller."""
    return min(1.0, max(0.0, x)) if not math.isnan(x) else 0.0


def _view(node: str, e: EngineStatus) -> EngineView:
    """What the router believes of a ready engine: the node's figures, each clamped to what one engine can be."""
    return EngineView(
        e.engine_id,
        node,
        e.model,
        frozenset(e.ops),
        _count(e.in_flight, MAX_IN_FLIGHT),
        slots=_count(e.slots, MAX_SLOTS) or 1,
        reported=min(_count(e.slots_busy, MAX_IN_FLIGHT) + _count(e.queued, MAX_IN_FLIGHT), MAX_IN_FLIGHT),
        kv_used=_share(e.kv_used),
    )


@dataclass(frozen=True)
class LoadGuard:
    """When a warm engine is too busy to keep its conversations.

    The warm engine is passed over when its load (in flight + picks since its last heartbeat) exceeds both
    `ratio` times the least-busy holder's load and that load plus `slack`. A cold prefill costs one request
    once; queueing behind a hot engine costs every request queued, so the guard only trips on a clear gap:
    with the defaults, 4 vs 0 stays warm, 5 vs 0 moves; 8 vs 4 stays, 9 vs 4 moves. An engine with slots to
    spare is never passed over: 6 in flight on 8 slots stays warm whatever the others carry, unless its KV cache
    is nearly full (`KV_FULL`): then no slot of it is really free, and the load gap alone decides. The least-busy
    holder it is weighed against is one with room in its cache, when there is one (`EngineTable.least_busy`).
    """

    ratio: float = 2.0
    slack: int = 4

    def overloaded(self, warm: EngineView, least: EngineView) -> bool:
        # an engine with a free slot (llama-server's --parallel) and room in its cache takes the conversation at
        # once: never passed over
        free = warm.load < warm.slots and not warm.kv_full
        return not free and warm.load > max(least.load * self.ratio, least.load + self.slack)


def affinity_keys(req: RouteRequest) -> list[tuple[RouteReason, str]]:
    """(reason, key) pairs, strongest first; prefix elements from the longest down."""
    prefixes: list[tuple[RouteReason, str]] = [("prefix", k) for k in reversed(req.prefix)]
    keys: list[tuple[RouteReason, str]] = [("session", req.session), ("user", req.user), *prefixes]
    return [(r, k) for r, k in keys if k]


def keys_to_record(req: RouteRequest) -> list[str]:
    """What a decision is remembered under: session, user, the chain's first and last elements.

    The first element keeps the conversation's home even when its chain is later bounded; the last is what
    the next turn (which extends this chain) finds as its longest match.
    """
    keys = [req.session, req.user] + (req.prefix[:1] + req.prefix[-1:] if req.prefix else [])
    return list(dict.fromkeys(k for k in keys if k))


def evicted_keys(hb: Heartbeat, table: EngineTable, affinity: Mapping[str, AffinityEntry]) -> list[str]:
    """The affinity keys the node's heartbeat says its engines' caches dropped (`EngineStatus.evicted`, from vLLM's
    KV events) that point at those very engines: what the router forgets, so the next turn goes to the least busy
    holder instead of a cold engine. Only engines the table routes to on that node count, and at most EVICTED_MAX
    keys each: a node can take conversations off its own engines only."""
    out: list[str] = []
    for e in hb.engines:
        view = table.engines.get(e.engine_id) if e.evicted else None
        if view is None or view.node_id != hb.node_id:
            continue
        for key in e.evicted[:EVICTED_MAX]:
            entry = affinity.get(key)
            if entry is not None and entry.engine_id == e.engine_id and entry.node_id == hb.node_id:
                out.append(key)
    return out


def _busy(model: ModelConfig | None, v: EngineView) -> bool:
    """The model may burst to a pod when busy, and `v` is at its threshold."""
    return model is not None and model.pod.burst in ("when_busy", "always") and v.load >= model.pod.busy_in_flight


def _decide(
    table: EngineTable, v: EngineView, reason: RouteReason, holders: int = 1, model: ModelConfig | None = None
) -> RouteDecision:
    busy = _busy(model, v) and reason != "pin"
    table.chose(v)
    return RouteDecision(engine_id=v.engine_id, node_id=v.node_id, reason=reason, holders=holders, busy=busy)


def pick(
    table: EngineTable,
    req: RouteRequest,
    affinity: Mapping[str, AffinityEntry] | None = None,
    model: ModelConfig | None = None,
    now: float = 0.0,
    guard: LoadGuard = LoadGuard(),
    ttl_s: float = AFFINITY_TTL_S,
) -> RouteDecision | None:
    """The engine for `req`, or None when no live engine holds the model. Raises BusError("no_engine") when a
    pin names an engine that is down and the pin does not allow fallback."""
    excluded = set(req.exclude)
    candidates = [v for v in table.holders(req.model, req.op) if v.engine_id not in excluded]
    fallback = False

    pin = req.pin or (model.pin if model else "")
    if pin:
        pinned = [v for v in candidates if pin in (v.engine_id, v.node_id)]
        if pinned:
            return _decide(table, table.least_busy(pinned), "pin", len(pinned))
        if req.pin or not (model and model.allow_fallback):
            raise BusError("no_engine", f"pinned engine {pin!r} is not serving {req.model!r}", retryable=True)
        fallback = True

    if not candidates:
        return None
    least = table.least_busy(candidates)
    by_id = {v.engine_id: v for v in candidates}
    known: Mapping[str, AffinityEntry] = affinity or {}
    for reason, key in affinity_keys(req) if known else ():
        entry = known.get(key)
        if entry is None or now - entry.ts > ttl_s:
            continue
        warm = by_id.get(entry.engine_id)
        # a bursting model's saturated engine yields to one that is not (a rented pod, when one has come up)
        if warm is None or guard.overloaded(warm, least) or (_busy(model, warm) and not _busy(model, least)):
            fallback = True  # the conversation had a home that cannot take it now
            continue
        return _decide(table, warm, reason, len(candidates), model)
    return _decide(table, least, "fallback" if fallback else "least_busy", len(candidates), model)


class RoundRobin:
    """A benchmark baseline: every holder in turn, ignoring load and affinity."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, table: EngineTable, req: RouteRequest) -> RouteDecision | None:
        excluded = set(req.exclude)
        candidates = sorted(
            (v for v in table.holders(req.model, req.op) if v.engine_id not in excluded), key=lambda v: v.engine_id
        )
        if not candidates:
            return None
        return _decide(table, candidates[next(self._counter) % len(candidates)], "least_busy", len(candidates))
