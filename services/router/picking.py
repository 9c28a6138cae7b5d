"""Pure routing: which live engine serves this request. No I/O; the service feeds it heartbeats."""

from __future__ import annotations

from dataclasses import dataclass, field

from coderai.contracts import Heartbeat, RouteDecision, RouteRequest


@dataclass
class EngineView:
    """What the router believes about one engine: its last heartbeat plus picks made since."""

    engine_id: str
    node_id: str
    model: str
    ops: frozenset[str]
    in_flight: int
    picks_since_hb: int = 0

    @property
    def load(self) -> int:
        """Heartbeats are ~2 s old at worst; picks made since then are load the heartbeat has not seen yet."""
        return self.in_flight + self.picks_since_hb


@dataclass
class EngineTable:
    """Engines by id, rebuilt per node from each heartbeat; a node silent for `ttl_s` is dropped."""

    ttl_s: float = 6.0
    engines: dict[str, EngineView] = field(default_factory=dict)
    node_seen: dict[str, float] = field(default_factory=dict)

    def apply(self, hb: Heartbeat, now: float) -> None:
        """Replace this node's engines with the heartbeat's ready ones."""
        self.node_seen[hb.node_id] = now
        for eid in [e for e, v in self.engines.items() if v.node_id == hb.node_id]:
            del self.engines[eid]
        for e in hb.engines:
            if e.state == "ready":
                self.engines[e.engine_id] = EngineView(e.engine_id, hb.node_id, e.model, frozenset(e.ops), e.in_flight)

    def expire(self, now: float) -> list[str]:
        """Forget nodes not heard from within the TTL; returns their ids."""
        gone = [n for n, t in self.node_seen.items() if now - t > self.ttl_s]
        for n in gone:
            del self.node_seen[n]
            for eid in [e for e, v in self.engines.items() if v.node_id == n]:
                del self.engines[eid]
        return gone

    def holders(self, model: str, op: str) -> list[EngineView]:
        return [v for v in self.engines.values() if v.model == model and op in v.ops]


def pick(table: EngineTable, req: RouteRequest) -> RouteDecision | None:
    """Least loaded live holder of the model and op, skipping excluded engines; ties go to the lowest id.

    Returns None when no engine qualifies. The chosen engine's pick counter goes up so that concurrent
    requests spread before the next heartbeat reports the new load.
    """
    excluded = set(req.exclude)
    candidates = [v for v in table.holders(req.model, req.op) if v.engine_id not in excluded]
    if not candidates:
        return None
    best = min(candidates, key=lambda v: (v.load, v.engine_id))
    best.picks_since_hb += 1
    return RouteDecision(engine_id=best.engine_id, node_id=best.node_id, reason="least_busy")
