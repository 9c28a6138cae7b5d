"""Residency: which models are loaded now, when the cluster holds more models than memory (docs/models.md).

A model's `resident` says how it is held: `always` (placed whenever it fits, never unloaded for idleness or
evicted), `on_demand` (placed only once a request asks for it, unloaded after `keep_alive_s` idle) or auto (`""`:
placed while it fits, like `always`, but evicted for another and unloaded when its `keep_alive_s` runs out; once off
a node it comes back on demand). `min_replicas` copies are held whatever the demand.

`Residency.plan` wraps the pure placement (`placement.plan`): it leaves out on-demand models nobody asked for and
the copies that went idle past their keep-alive, then, for a model asked for that fits nowhere, unloads the least
recently used idle copies (never one with a job in flight, never an `always` one) on the node that needs the fewest.
A copy taken off a node for idleness or eviction is parked there: not placed again until its model is asked for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from coderai.contracts import Assignment, EngineStatus, Heartbeat, ModelConfig
from coderai.scheduler.placement import Plan, plan

DEMAND_WINDOW_S = 300.0  # a request's demand for a model not placed yet is forgotten after this (the gateway's wait)
EVICT_IDLE_S = 3.0  # a copy idle for less may have taken a request since its heartbeat: not evicted yet

Pair = tuple[str, str]  # (model, node)


def mode(m: ModelConfig) -> str:
    return m.resident or "auto"


def keep_alive(m: ModelConfig, status: EngineStatus | None) -> float | None:
    """Seconds a copy of `m` may stay idle, as its last request or else its config says; None: forever."""
    return m.keep_alive(status.keep_alive_s if status is not None else None)


def engines(nodes: dict[str, Heartbeat]) -> dict[Pair, EngineStatus]:
    """Each node's engines by (model, node), as its last heartbeat reports them."""
    return {(e.model, n): e for n, hb in nodes.items() for e in hb.engines}


def idle(status: EngineStatus | None, for_s: float = 0.0) -> bool:
    """A copy that may be taken off its node: loaded, and no job running or queued for `for_s` (per its last
    heartbeat)."""
    return (
        status is not None
        and status.state == "ready"
        and not status.in_flight
        and not status.queued
        and status.idle_s >= for_s
    )


def evictable(status: EngineStatus | None) -> bool:
    """Unloaded for another model: idle for a while (a heartbeat is a moment old: one idle just now may be busy)."""
    return idle(status, EVICT_IDLE_S)


def in_use(status: EngineStatus | None) -> bool:
    """Busy or loading now, so maybe evictable later (when a request for another model may wait for it)."""
    return status is None or status.state in ("ready", "loading")


@dataclass
class Residency:
    demand: dict[str, float] = field(default_factory=dict)  # model -> when a request last asked for it unloaded
    parked: set[Pair] = field(default_factory=set)  # copies unloaded for idleness or eviction, until asked for
    gone: dict[Pair, Literal["idle", "evicted"]] = field(
        default_factory=dict
    )  # why a copy left its node: idle, evicted (for ModelUnloaded)
    no_room: dict[str, str] = field(default_factory=dict)  # model asked for -> why it could not be placed
    waiting: set[str] = field(default_factory=set)  # models asked for that fit once copies in use go idle

    def ask(self, name: str, now: float | None = None) -> None:
        """A request wants `name` and no engine serves it: place it (evicting for it if need be) on the next plan."""
        self.demand[name] = time.monotonic() if now is None else now
        self.parked = {p for p in self.parked if p[0] != name}
        self.no_room.pop(name, None)

    def expired(
        self, models: list[ModelConfig], nodes: dict[str, Heartbeat], current: dict[str, Assignment]
    ) -> list[Pair]:
        """Copies idle past their keep-alive, oldest first, keeping each model's `min_replicas` copies."""
        by_name = {m.name: m for m in models}
        status = engines(nodes)
        copies: dict[str, int] = {}
        for n, a in current.items():
            for x in a.models:
                if n in nodes and (x.name, n) not in self.parked:
                    copies[x.name] = copies.get(x.name, 0) + 1
        out: list[tuple[float, Pair]] = []
        for n, a in current.items():
            for x in a.models:
                m, s = by_name.get(x.name), status.get((x.name, n))
                if m is None or s is None or n not in nodes or (x.name, n) in self.parked or not idle(s):
                    continue
                k = keep_alive(m, s)
                if k is not None and s.idle_s > k:
                    out.append((-s.idle_s, (x.name, n)))
        gone: list[Pair] = []
        for _, (name, n) in sorted(out):
            if copies.get(name, 0) > by_name[name].min_replicas:
                copies[name] -= 1
                gone.append((name, n))
        return gone

    def wanted(self, models: list[ModelConfig], current: dict[str, Assignment], now: float) -> list[ModelConfig]:
        """The models to place: all but the on-demand ones nobody asked for and none holds (past their
        `min_replicas`), an on-demand one as `replicas` copies (1 unless it says)."""
        held = {x.name for n, a in current.items() for x in a.models if (x.name, n) not in self.parked}
        out = []
        for m in models:
            if mode(m) == "on_demand":
                asked = now - self.demand.get(m.name, -1e18) <= DEMAND_WINDOW_S
                if not (asked or m.name in held or m.min_replicas):
                    continue
                m = msgspec.structs.replace(m, replicas=m.replicas or max(1, m.min_replicas))
            out.append(m)
        return out

    def plan(
        self,
        models: list[ModelConfig],
        nodes: dict[str, Heartbeat],
        current: dict[str, Assignment],
        layers: dict[str, int] | None = None,
        now: float | None = None,
    ) -> Plan:
        """`placement.plan` of what should be loaded now (see the module's doc); records why copies leave."""
        now = time.monotonic() if now is None else now
        for pair in self.expired(models, nodes, current):
            self.parked.add(pair)
            self.gone[pair] = "idle"
        self.demand = {k: t for k, t in self.demand.items() if now - t <= DEMAND_WINDOW_S}
        want = self.wanted(models, current, now)
        result = plan(want, nodes, current, layers=layers, exclude=self.parked)
        for name in sorted(self.demand, key=self.demand.__getitem__):
            m = next((x for x in want if x.name == name), None)
            if m is None or placed(result, name, nodes):
                self.demand.pop(name, None)
                continue
            evict = self._room_for(m, want, nodes, current, result, layers, evictable)
            if evict is None:
                if self._room_for(m, want, nodes, current, result, layers, in_use) is not None:
                    self.waiting.add(name)  # room once copies in use now go idle: the request waits for them
                else:
                    self.waiting.discard(name)
                    why = result.unplaced.get(name) or "it fits no live node"
                    if any(m.engine in hb.capabilities and (not m.nodes or n in m.nodes) for n, hb in nodes.items()):
                        why += ", and no idle model can be unloaded to make room"
                    self.no_room[name] = why
                continue
            self.waiting.discard(name)
            for pair in evict:
                self.parked.add(pair)
                self.gone[pair] = "evicted"
            result = plan(want, nodes, current, layers=layers, exclude=self.parked)
            self.demand.pop(name, None)
        self.waiting &= set(self.demand)
        parked = {name for name, _ in self.parked}  # not loaded until asked for: not "unplaced"
        result.unplaced = {k: v for k, v in result.unplaced.items() if k not in parked or k in self.demand}
        return result

    def _room_for(
        self,
        m: ModelConfig,
        want: list[ModelConfig],
        nodes: dict[str, Heartbeat],
        current: dict[str, Assignment],
        result: Plan,
        layers: dict[str, int] | None,
        may_go: Callable[[EngineStatus | None], bool],
    ) -> list[Pair] | None:
        """The fewest least-recently-used copies that `may_go` to unload so that `m` is placed, on one node; None
        when no node can make room."""
        status = engines(nodes)
        by_name = {x.name: x for x in want}
        copies: dict[str, int] = {}
        for n, a in result.assignments.items():
            for x in a.models:
                if n in nodes:
                    copies[x.name] = copies.get(x.name, 0) + 1
        best: list[Pair] | None = None
        for n in sorted(nodes):
            if m.engine not in nodes[n].capabilities or (m.nodes and n not in m.nodes):
                continue
            victims = sorted(
                (
                    (x.name, n)
                    for x in result.assignments.get(n, Assignment(node_id=n)).models
                    if x.name != m.name
                    and mode(by_name[x.name]) != "always"
                    and may_go(status.get((x.name, n)))
                    and copies.get(x.name, 0) > by_name[x.name].min_replicas
                ),
                key=lambda p: (-status[p].idle_s if p in status else 0.0, p[0]),
            )
            taken: list[Pair] = []
            for pair in victims:
                if best is not None and len(taken) + 1 >= len(best):
                    break
                taken.append(pair)
                trial = plan(want, nodes, current, layers=layers, exclude=self.parked | set(taken))
                if placed(trial, m.name, nodes):
                    best = list(taken)
                    break
        return best


def placed(result: Plan, name: str, nodes: dict[str, Heartbeat]) -> bool:
    """Whether the plan gives `name` a copy on a live node."""
    return any(x.name == name for n, a in result.assignments.items() if n in nodes for x in a.models)
