"""The scheduler's state and the one function that changes it: `apply(state, event) -> state`.

Whatever changes what the scheduler knows (a model added, replaced or removed over the bus, the models file or a
fine-tuning job; a node heard, gone silent or revoked; an assignment pass's outcome) is an event here, and the
service's only write to its state is `state = apply(state, event)`. `apply` never changes the state it is given:
each event returns a new `State` sharing what it left alone, so a reader holding the old one sees it whole.
What follows a change (an assignment pass, a bucket write) stays with the service.

Residency (demand, parked and evicted copies) keeps its own state machine in `residency.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Union

from coderai.contracts import Heartbeat, ModelConfig
from coderai.contracts.split import SplitPlan
from coderai.scheduler.placement import Plan


@dataclass(frozen=True)
class State:
    """What the scheduler knows; read it, never change it in place (`apply` makes the next one)."""

    models: list[ModelConfig] = field(default_factory=list)  # what it serves, in the order they came
    nodes: dict[str, Heartbeat] = field(default_factory=dict)  # each node's last heartbeat
    seen: dict[str, float] = field(default_factory=dict)  # node -> when it was last heard (monotonic)
    revoked_at: dict[str, float] = field(default_factory=dict)  # node -> when it was revoked (monotonic)
    unplaced: dict[str, str] = field(default_factory=dict)  # model -> why it has fewer copies than asked
    splits: dict[str, SplitPlan] = field(default_factory=dict)  # model -> its copy split over several nodes
    restaged: dict[str, ModelConfig] = field(default_factory=dict)  # video models published relayed by stages
    layers: dict[str, int] = field(default_factory=dict)  # blocks per llama model, read once from its GGUF
    last_plan: Plan = field(default_factory=lambda: Plan({}))


@dataclass(frozen=True)
class ModelsLoaded:
    """The whole model set, as the models file or the bucket has it at start."""

    models: tuple[ModelConfig, ...]


@dataclass(frozen=True)
class ModelSet:
    """A model added, or replaced in its place by one of its name."""

    model: ModelConfig


@dataclass(frozen=True)
class ModelRemoved:
    name: str


@dataclass(frozen=True)
class NodeSeen:
    """A heartbeat from a node, heard at `at`."""

    heartbeat: Heartbeat
    at: float


@dataclass(frozen=True)
class NodeGone:
    """A node whose heartbeats stopped."""

    node_id: str


@dataclass(frozen=True)
class NodeRevoked:
    """A node revoked at `at`: gone now, and its heartbeats ignored for a while (`heard`)."""

    node_id: str
    at: float


@dataclass(frozen=True)
class LayersRead:
    """Block counts read from models' GGUF files."""

    layers: dict[str, int]


@dataclass(frozen=True)
class Planned:
    """An assignment pass's outcome."""

    plan: Plan


Event = Union[ModelsLoaded, ModelSet, ModelRemoved, NodeSeen, NodeGone, NodeRevoked, LayersRead, Planned]


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key} if key in d else d


def _model_changed(state: State, name: str, models: list[ModelConfig]) -> State:
    # the plain config is what was just published: the next plan says again whether it is restaged; its file may
    # be another now, so its blocks are read again
    return replace(state, models=models, restaged=_without(state.restaged, name), layers=_without(state.layers, name))


def apply(state: State, event: Event) -> State:
    """The state after `event`."""
    match event:
        case ModelsLoaded(models=models):
            return replace(state, models=list(models))
        case ModelSet(model=m):
            if any(x.name == m.name for x in state.models):
                models = [m if x.name == m.name else x for x in state.models]
            else:
                models = [*state.models, m]
            return _model_changed(state, m.name, models)
        case ModelRemoved(name=name):
            return _model_changed(state, name, [x for x in state.models if x.name != name])
        case NodeSeen(heartbeat=hb, at=at):
            return replace(state, nodes={**state.nodes, hb.node_id: hb}, seen={**state.seen, hb.node_id: at})
        case NodeGone(node_id=node_id):
            return replace(state, nodes=_without(state.nodes, node_id), seen=_without(state.seen, node_id))
        case NodeRevoked(node_id=node_id, at=at):
            return replace(
                state,
                nodes=_without(state.nodes, node_id),
                seen=_without(state.seen, node_id),
                revoked_at={**state.revoked_at, node_id: at},
            )
        case LayersRead(layers=layers):
            return replace(state, layers={**state.layers, **layers})
        case Planned(plan=p):
            return replace(
                state,
                last_plan=p,
                unplaced=p.unplaced,
                restaged=p.restaged,
                splits={name: split for name, (_, split) in p.splits.items()},
            )
    raise TypeError(f"not a scheduler event: {event!r}")


def heard(state: State, hb: Heartbeat, now: float, ttl_s: float) -> bool:
    """Whether a heartbeat counts: one a revoked node sent before its revocation may still be on its way, so a
    re-admitted node is heard again only a heartbeat timeout after it."""
    return now - state.revoked_at.get(hb.node_id, -ttl_s) >= ttl_s


def joined(old: Heartbeat | None, hb: Heartbeat) -> bool:
    """A node new to the scheduler, or one whose engine families, RPC server or addresses changed: placement may
    change with it."""
    return (
        old is None
        or set(hb.capabilities) != set(old.capabilities)
        or (old.rpc and old.rpc.endpoint) != (hb.rpc and hb.rpc.endpoint)
        or old.addrs != hb.addrs
    )


def silent(state: State, now: float, ttl_s: float) -> list[str]:
    """Nodes not heard from for longer than `ttl_s`."""
    return [n for n, t in state.seen.items() if now - t > ttl_s]


def live(state: State, now: float, ttl_s: float, pods: bool = True) -> dict[str, Heartbeat]:
    """The nodes heard from within `ttl_s` (without pods, which bring their own models, unless `pods`)."""
    return {n: hb for n, hb in state.nodes.items() if (pods or not hb.pod) and now - state.seen.get(n, 0) <= ttl_s}
