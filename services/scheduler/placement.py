"""Pure placement: which node should load which model, by memory fit.

A copy of a model needs, and a node offers, what `coderai.sizing` says (shared with the catalogue). Existing placements are kept while they still fit (a new node joining moves nothing), then
missing copies go to eligible nodes that fit: `spread` picks the node holding the fewest models (then most room),
`binpack` the fullest node that still fits. A model with `replicas = 0` goes to every eligible node that fits.
A llama model that fits no node is split over a serving node and other nodes' RPC servers (`splitting`); one
whose config names `rpc_nodes` is split over those first, and placed whole only when none of them is live.
A video model relayed by stages (`params.stages`) needs only its biggest part on a node; one that fits no node
whole but whose biggest part fits is relayed by stages automatically. A folder model counts every file in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from coderai.contracts import Assignment, Heartbeat, ModelConfig
from coderai.contracts.split import SplitPlan
from coderai.sizing import MB, capacity, estimate_bytes
from coderai.scheduler.splitting import (
    Split,
    can_split,
    gate_peers,
    needs_ray,
    place_ray,
    place_split,
    wants_pinned_split,
)

def staged(m: ModelConfig) -> bool:
    """A video model relayed stage by stage (`params.stages`): a node holds only the parts its stages need."""
    return m.engine == "video" and bool(m.params.get("stages"))


def largest_part(m: ModelConfig) -> int:
    """What the biggest single stage of a video model needs (text encoder, UNet or VAE)."""
    from coderai.scheduler.stages import model_parts  # stages builds on this module

    return max(model_parts(m.path).need.values())


@dataclass
class Plan:
    assignments: dict[str, Assignment]
    unplaced: dict[str, str] = field(default_factory=dict)  # model -> why it has fewer copies than asked
    splits: dict[str, tuple[str, SplitPlan]] = field(default_factory=dict)  # model -> (serving node, devices)
    restaged: dict[str, ModelConfig] = field(default_factory=dict)  # video models relayed by stages to fit


def plan(
    models: list[ModelConfig],
    nodes: dict[str, Heartbeat],
    current: dict[str, Assignment] | None = None,
    sizes: dict[str, int] | None = None,
    layers: dict[str, int] | None = None,
    exclude: frozenset[tuple[str, str]] | set[tuple[str, str]] = frozenset(),
) -> Plan:
    """Assignments for live `nodes` (plus, for nodes in `current` that are gone, what they keep for their return).
    `layers`: blocks per model, where the scheduler could read them (for the layer map of a split); `exclude`:
    (model, node) pairs not to place (a copy being evicted or unloaded for idleness: `residency`)."""
    current = current or {}
    sizes = sizes or {}
    layers = layers or {}
    # a video model that fits no node whole is relayed by stages when its biggest part fits one (the gateway
    # learns it from the config the scheduler publishes: `restaged`)
    roomiest = max((capacity(hb) for hb in nodes.values()), default=0)
    need: dict[str, int] = {}
    restaged: dict[str, ModelConfig] = {}
    sized: list[ModelConfig] = []
    for m in models:
        if staged(m) and not m.memory_mb:
            need[m.name] = largest_part(m)
        else:
            need[m.name] = estimate_bytes(m, sizes.get(m.name))
            if m.engine == "video" and not m.memory_mb and nodes and need[m.name] > roomiest:
                part = largest_part(m)
                if part <= roomiest:
                    m = restaged[m.name] = msgspec.structs.replace(m, params={**m.params, "stages": True})
                    need[m.name] = part
        sized.append(m)
    models = sized
    free = {n: capacity(hb) for n, hb in nodes.items()}
    placed: dict[str, list[ModelConfig]] = {n: [] for n in nodes}
    unplaced: dict[str, str] = {}

    def eligible(m: ModelConfig, n: str) -> bool:
        return m.engine in nodes[n].capabilities and (not m.nodes or n in m.nodes) and (m.name, n) not in exclude

    def put(m: ModelConfig, n: str) -> None:
        placed[n].append(m)
        free[n] -= need[m.name]

    candidates = {m.name: sorted(n for n in nodes if eligible(m, n)) for m in models}
    wants = {m.name: len(candidates[m.name]) if m.replicas == 0 else m.replicas for m in models}
    wants = {m.name: min(wants[m.name], m.max_replicas) if m.max_replicas else wants[m.name] for m in models}
    splits: dict[str, tuple[str, SplitPlan]] = {}
    peers: dict[str, set[str]] = {n: set() for n in nodes}
    rpc_used: set[str] = set()

    def split(m: ModelConfig) -> str:
        """Place `m` as one split copy; "" on success, else why not."""
        now = next(((n, x.shards) for n, a in current.items() for x in a.models if x.name == m.name and x.shards), ("", None))
        got = place_split(m, need[m.name], candidates[m.name], nodes, free, now[1], now[0], layers.get(m.name, 0), rpc_used)
        if not isinstance(got, Split):
            return got
        placed[got.serving].append(msgspec.structs.replace(m, shards=got.plan))
        for n, b in got.takes.items():
            free[n] -= b
        for d in got.plan.remote():
            peers[d.node_id].update(gate_peers(nodes[got.serving], d.endpoint))
            rpc_used.add(d.node_id)
        splits[m.name] = (got.serving, got.plan)
        return ""

    def over_ray(m: ModelConfig) -> str:
        """Place `m` over several nodes' vLLM ranks; "" on success, else why not."""
        got = place_ray(m, need[m.name], candidates[m.name], nodes, free)
        if not isinstance(got, Split):
            return got
        for d in got.plan.devices:  # every node of the plan runs a part: the serving one, the others join its Ray
            placed[d.node_id].append(msgspec.structs.replace(m, shards=got.plan))
            free[d.node_id] -= got.takes[d.node_id]
        splits[m.name] = (got.serving, got.plan)
        return ""

    pinned = {m.name for m in models if wants_pinned_split(m, nodes) and not split(m)}
    pinned |= {m.name for m in models if needs_ray(m, nodes, candidates[m.name])}
    for name in sorted(pinned - set(splits)):  # vLLM over Ray: placed here, before whole copies
        m = next(x for x in models if x.name == name)
        if why := over_ray(m):
            unplaced[m.name] = why
    for m in models:  # first every copy already in place that still fits, so no new copy can push one out
        if m.name in pinned:
            continue
        holders = [n for n in candidates[m.name] if any(x.name == m.name for x in current.get(n, Assignment(node_id=n)).models)]
        for n in holders[: wants[m.name]]:
            if free[n] >= need[m.name]:
                put(m, n)
    for m in models:  # then the missing copies
        if m.name in pinned:
            continue
        want = wants[m.name]
        have = [n for n in candidates[m.name] if m in placed[n]]
        rest = [n for n in candidates[m.name] if n not in have and free[n] >= need[m.name]]
        if m.placement == "binpack":
            rest.sort(key=lambda n: (free[n], n))
        else:
            rest.sort(key=lambda n: (len(placed[n]), -free[n], n))
        for n in rest[: max(0, want - len(have))]:
            put(m, n)
        got = sum(m in placed[n] for n in candidates[m.name])
        if got == 0 and want > 0 and can_split(m) and candidates[m.name]:
            why = split(m)  # fits no single node: over several, if RPC servers together have the room
            if not why:
                continue
            unplaced[m.name] = f"0 of {want} copies fit ({need[m.name] // MB} MB each); no split either: {why}"
            continue
        if not candidates[m.name]:
            unplaced[m.name] = ("none of its nodes (" + ", ".join(m.nodes) + ") is live and runs its engine family") \
                if m.nodes else "no live node runs its engine family"
        elif got < want:
            unplaced[m.name] = f"{got} of {want} copies fit ({need[m.name] // MB} MB each)"

    out = {n: Assignment(node_id=n, models=ms, rpc_peers=sorted(peers[n])) for n, ms in sorted(placed.items())}
    by_name = {m.name: m for m in models}
    for n, a in current.items():  # gone nodes: keep the everywhere-models for when they come back
        if n not in nodes:
            keep = [by_name[x.name] for x in a.models if x.name in by_name and by_name[x.name].replicas == 0]
            out[n] = Assignment(node_id=n, models=keep)
    return Plan(out, unplaced, splits, restaged)
