"""Pure placement: which node should load which model, by memory fit.

A copy of a model needs, and a node offers, what `coderai.sizing` says (shared with the catalogue). Existing placements are kept while they still fit (a new node joining moves nothing), then
missing copies go to eligible nodes that fit: `spread` picks the node holding the fewest models (then most room),
`binpack` the fullest node that still fits. A model with `replicas = 0` goes to every eligible node that fits.
A llama model that fits no node is split over a serving node and other nodes' RPC servers (`splitting`); one
whose config names `rpc_nodes` is split over those first, and placed whole only when none of them is live.
A video model relayed by stages (`params.stages`) needs only its biggest part on a node; one that fits no node
whole but whose biggest part fits is relayed by stages automatically. A folder model counts every file in it.

Memory is counted per pool (`sizing.pools`): a copy that runs on the CPU (`sizing.runs_on_cpu`, or a node without
GPUs) takes RAM only; one that runs on a GPU takes one card of its node, the smallest card that holds it (ties: the
roomiest under `spread`, the fullest under `binpack`), so the big cards stay free for the big models. A llama.cpp
model that fits no single card but several together takes the fewest roomiest cards that hold it, shared by their
room (its tensor split); a vLLM model takes one card per rank. The cards go into the copy's `devices`, and a copy
in place keeps its cards while they hold it. A split over RPC servers runs on the serving node's CPU: RAM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from coderai.contracts import GGUF_FAMILIES, Assignment, Heartbeat, ModelConfig
from coderai.contracts.split import SplitPlan
from coderai.sizing import MB, Pools, estimate_bytes, pools, runs_on_cpu
from coderai.scheduler.splitting import (
    Split,
    can_split,
    gate_peers,
    needs_ray,
    place_ray,
    place_split,
    wants_pinned_split,
    world_size,
)

RAM = -1  # the pool key of a node's RAM in a `Take`; GPUs are keyed by their index
Take = dict[int, int]  # pool -> bytes one copy takes of it


def staged(m: ModelConfig) -> bool:
    """A video model relayed stage by stage (`params.stages`): a node holds only the parts its stages need."""
    return m.engine == "video" and bool(m.params.get("stages"))


def largest_part(m: ModelConfig) -> int:
    """What the biggest single stage of a video model needs (text encoder, UNet or VAE)."""
    from coderai.scheduler.stages import model_parts  # stages builds on this module

    return max(model_parts(m.path).need.values())


def fetch_first(m: ModelConfig, hb: Heartbeat) -> int:
    """0 when the node already holds the model's files from the store (it loads without fetching), else 1."""
    if not m.store_path:
        return 1
    if m.store_path.endswith("/"):
        return 0 if any(p.startswith(m.store_path) for p in hb.stored) else 1
    return 0 if m.store_path in hb.stored else 1


@dataclass
class Plan:
    assignments: dict[str, Assignment]
    unplaced: dict[str, str] = field(default_factory=dict)  # model -> why it has fewer copies than asked
    splits: dict[str, tuple[str, SplitPlan]] = field(default_factory=dict)  # model -> (serving node, devices)
    restaged: dict[str, ModelConfig] = field(default_factory=dict)  # video models relayed by stages to fit


@dataclass
class Room:
    """One pass's state as copies go in: what each node's pools have left, what each holds, and the splits made.
    The pure steps below read it and the placing ones (`use`, `put`, `split_copy`, `ray_copy`) add to it."""

    nodes: dict[str, Heartbeat]
    free: dict[str, Pools]  # what is left of each pool
    full: dict[str, list[int]]  # each card's full room, to prefer the smallest that holds
    placed: dict[str, list[ModelConfig]]
    peers: dict[str, set[str]]  # node -> addresses its RPC server's gate admits
    rpc_used: set[str] = field(default_factory=set)  # an RPC server holds layers of one split model at a time
    splits: dict[str, tuple[str, SplitPlan]] = field(default_factory=dict)

    @classmethod
    def of(cls, nodes: dict[str, Heartbeat]) -> Room:
        """Every live node at full room, holding nothing."""
        free = {n: pools(hb) for n, hb in nodes.items()}
        return cls(
            nodes, free, {n: list(r.gpus) for n, r in free.items()}, {n: [] for n in nodes}, {n: set() for n in nodes}
        )


def on_gpu(m: ModelConfig, r: Pools) -> bool:
    """A copy of `m` on a node with pools `r` runs on a GPU (else on the CPU: RAM)."""
    return bool(r.gpus) and not runs_on_cpu(m)


def biggest(m: ModelConfig, r: Pools) -> int:
    """The most one pool offers `m` (a video cannot be cut over cards)."""
    return max(r.gpus) if on_gpu(m, r) else r.ram


def free_for(m: ModelConfig, r: Pools) -> int:
    """The room `m` could use on a node in all (its pool kind), to rank nodes by."""
    return sum(r.gpus) if on_gpu(m, r) else r.ram


def sized(
    models: list[ModelConfig],
    nodes: dict[str, Heartbeat],
    sizes: dict[str, int],
) -> tuple[list[ModelConfig], dict[str, int], dict[str, ModelConfig]]:
    """What one copy of each model needs, with the models as placed and those `restaged`: a video model that fits
    no node whole is relayed by stages when its biggest part fits one (the gateway learns it from the config the
    scheduler publishes)."""
    full = {n: pools(hb) for n, hb in nodes.items()}
    need: dict[str, int] = {}
    restaged: dict[str, ModelConfig] = {}
    out: list[ModelConfig] = []
    for m in models:
        if staged(m) and not m.memory_mb:
            need[m.name] = largest_part(m)
        else:
            need[m.name] = estimate_bytes(m, sizes.get(m.name))
            roomiest = max((biggest(m, r) for r in full.values()), default=0)
            if m.engine == "video" and not m.memory_mb and nodes and need[m.name] > roomiest:
                part = largest_part(m)
                if part <= roomiest:
                    m = restaged[m.name] = msgspec.structs.replace(m, params={**m.params, "stages": True})
                    need[m.name] = part
        out.append(m)
    return out, need, restaged


def eligible(m: ModelConfig, n: str, hb: Heartbeat, exclude: frozenset[tuple[str, str]] | set[tuple[str, str]]) -> bool:
    """Node `n` runs `m`'s engine family, is one `m` names (if it names any), and is not excluded for it."""
    return m.engine in hb.capabilities and (not m.nodes or n in m.nodes) and (m.name, n) not in exclude


def wanted(m: ModelConfig, candidates: list[str]) -> int:
    """Copies `m` asks for: its replicas, or every candidate for `replicas = 0`, capped by `max_replicas`."""
    want = len(candidates) if m.replicas == 0 else m.replicas
    return min(want, m.max_replicas) if m.max_replicas else want


def shared(b: int, free: list[int], devs: list[int]) -> Take | None:
    """`b` bytes over the cards `devs` by their room (llama.cpp's tensor split), if they hold it."""
    total = sum(max(0, free[i]) for i in devs)
    if total < b:
        return None
    return {i: b * max(0, free[i]) // total for i in devs} if len(devs) > 1 else {devs[0]: b}


def take(m: ModelConfig, b: int, r: Pools, full: list[int], keep: list[int] | None = None) -> Take | None:
    """The pools one copy of `m` (`b` bytes) takes of a node with pools `r` left of `full` cards (`keep`: the cards
    it holds now, kept while they hold it); None when it does not fit."""
    if not on_gpu(m, r):
        return {RAM: b} if r.ram >= b else None
    if not r.indexed:  # a node that reported only its total: one pool, no card to pin
        return {0: b} if r.gpus[0] >= b else None
    ranks = world_size(m)
    if keep and all(0 <= i < len(r.gpus) for i in keep):
        if ranks == 1 and (got := shared(b, r.gpus, keep)) is not None:
            return got
        if ranks > 1 and len(keep) == ranks and all(r.gpus[i] >= b // ranks for i in keep):
            return {i: b // ranks for i in keep}
    if ranks > 1:  # vLLM, SGLang: one card per rank, an equal share on each
        ok = sorted((i for i, f in enumerate(r.gpus) if f >= b // ranks), key=lambda i: (-r.gpus[i], i))
        return {i: b // ranks for i in sorted(ok[:ranks])} if len(ok) >= ranks else None
    whole = [i for i, f in enumerate(r.gpus) if f >= b]
    if whole:
        sign = 1 if m.placement == "binpack" else -1
        return {min(whole, key=lambda i: (full[i], sign * r.gpus[i], i)): b}
    if m.engine not in GGUF_FAMILIES:
        return None
    chosen: list[int] = []
    for i in sorted(range(len(r.gpus)), key=lambda i: (-r.gpus[i], i)):
        if r.gpus[i] <= 0:
            break
        chosen.append(i)
        if (got := shared(b, r.gpus, sorted(chosen))) is not None:
            return got
    return None


def use(r: Pools, t: Take) -> None:
    """Take `t` out of the pools `r`."""
    for pool, b in t.items():
        if pool == RAM:
            r.ram -= b
        else:
            r.gpus[pool] -= b


def put(room: Room, m: ModelConfig, n: str, t: Take) -> None:
    """Place one copy of `m` on `n`, taking `t`; the copy names its cards (none on RAM or an unindexed node)."""
    devices = sorted(t) if room.free[n].indexed and RAM not in t else []
    room.placed[n].append(m if devices == m.devices else msgspec.structs.replace(m, devices=devices))
    use(room.free[n], t)


def holds(room: Room, n: str, name: str) -> bool:
    return any(x.name == name for x in room.placed[n])


def split_copy(
    room: Room, m: ModelConfig, b: int, candidates: list[str], current: dict[str, Assignment], layers: int
) -> str:
    """Place `m` as one split copy (on the serving node's CPU and the RPC servers: RAM); "" on success, else why
    not."""
    now = next(
        ((n, x.shards) for n, a in current.items() for x in a.models if x.name == m.name and x.shards), ("", None)
    )
    ram = {n: r.ram for n, r in room.free.items()}
    got = place_split(m, b, candidates, room.nodes, ram, now[1], now[0], layers, room.rpc_used)
    if not isinstance(got, Split):
        return got
    room.placed[got.serving].append(msgspec.structs.replace(m, shards=got.plan))
    for n, nb in got.takes.items():
        use(room.free[n], {RAM: nb})
    for d in got.plan.remote():
        room.peers[d.node_id].update(gate_peers(room.nodes[got.serving], d.endpoint))
        room.rpc_used.add(d.node_id)
    room.splits[m.name] = (got.serving, got.plan)
    return ""


def ray_copy(room: Room, m: ModelConfig, b: int, candidates: list[str]) -> str:
    """Place `m` over several nodes' vLLM or SGLang ranks; "" on success, else why not."""
    got = place_ray(m, b, candidates, room.nodes, {n: free_for(m, room.free[n]) for n in room.nodes})
    if not isinstance(got, Split):
        return got
    for d in got.plan.devices:  # every node of the plan runs a part: the serving one, the others join its Ray
        room.placed[d.node_id].append(msgspec.structs.replace(m, shards=got.plan))
        r = room.free[d.node_id]
        ranks = sorted(range(len(r.gpus)), key=lambda i: (-r.gpus[i], i))[: max(1, d.ranks)]
        use(r, {i: got.takes[d.node_id] // len(ranks) for i in ranks} if on_gpu(m, r) else {RAM: got.takes[d.node_id]})
    room.splits[m.name] = (got.serving, got.plan)
    return ""


def keep_held(
    room: Room, m: ModelConfig, b: int, candidates: list[str], current: dict[str, Assignment], want: int
) -> None:
    """Keep the copies of `m` already in place (up to `want`) while they still fit, on the cards they hold."""
    held = {n: x for n in candidates for x in current.get(n, Assignment(node_id=n)).models if x.name == m.name}
    for n in list(held)[:want]:
        if (t := take(m, b, room.free[n], room.full[n], held[n].devices)) is not None:
            put(room, m, n, t)


def lora_hosts(m: ModelConfig, models: list[ModelConfig]) -> list[str]:
    """The vLLM models whose server a fine-tuned vLLM model `m` can load its adapter into at run time: its base
    with LoRA on, and the other fine-tuned models of the same base (engines/vllm.py)."""
    base = m.param_str("base") if m.engine == "vllm" else None
    if not base:
        return []
    return [
        x.name
        for x in models
        if x.engine == "vllm"
        and x.name != m.name
        and (x.param_str("base") == base or (x.path == base and x.param_bool("enable_lora")))
    ]


def add_copies(
    room: Room, m: ModelConfig, b: int, candidates: list[str], want: int, near: list[str] | None = None
) -> int:
    """Place the copies of `m` still missing on the candidates that fit, best first (a node holding one of `near`,
    whose server it shares; then `spread`: a node that has its files, then the fewest models, then the most room;
    `binpack`: the fullest); how many copies it has now."""
    have = [n for n in candidates if holds(room, n, m.name)]
    rest = [n for n in candidates if n not in have and take(m, b, room.free[n], room.full[n]) is not None]
    apart = {n: not any(holds(room, n, x) for x in near or ()) for n in rest}
    if m.placement == "binpack":
        rest.sort(key=lambda n: (apart[n], fetch_first(m, room.nodes[n]), free_for(m, room.free[n]), n))
    else:
        rest.sort(
            key=lambda n: (
                apart[n],
                fetch_first(m, room.nodes[n]),
                len(room.placed[n]),
                -free_for(m, room.free[n]),
                n,
            )
        )
    for n in rest[: max(0, want - len(have))]:
        if (t := take(m, b, room.free[n], room.full[n])) is not None:  # it does: `rest` holds the nodes it fits
            put(room, m, n, t)
    return sum(holds(room, n, m.name) for n in candidates)


def shortfall(m: ModelConfig, got: int, want: int, b: int, candidates: list[str]) -> str:
    """Why `m` has fewer copies than it asks for ("" when it has them all)."""
    if not candidates:
        return (
            ("none of its nodes (" + ", ".join(m.nodes) + ") is live and runs its engine family")
            if m.nodes
            else "no live node runs its engine family"
        )
    if got < want:
        return f"{got} of {want} copies fit ({b // MB} MB each)"
    return ""


def kept_for_return(
    models: list[ModelConfig], nodes: dict[str, Heartbeat], current: dict[str, Assignment]
) -> dict[str, Assignment]:
    """Gone nodes keep the everywhere-models (`replicas = 0`, on their cards) for when they come back."""
    by_name = {m.name: m for m in models}
    out: dict[str, Assignment] = {}
    for n, a in current.items():
        if n not in nodes:
            keep = [
                msgspec.structs.replace(by_name[x.name], devices=x.devices)
                for x in a.models
                if x.name in by_name and by_name[x.name].replicas == 0
            ]
            out[n] = Assignment(node_id=n, models=keep)
    return out


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
    layers = layers or {}
    models, need, restaged = sized(models, nodes, sizes or {})
    room = Room.of(nodes)
    unplaced: dict[str, str] = {}
    candidates = {m.name: sorted(n for n, hb in nodes.items() if eligible(m, n, hb, exclude)) for m in models}
    wants = {m.name: wanted(m, candidates[m.name]) for m in models}

    pinned = {
        m.name
        for m in models
        if wants_pinned_split(m, nodes)
        and not split_copy(room, m, need[m.name], candidates[m.name], current, layers.get(m.name, 0))
    }
    pinned |= {m.name for m in models if needs_ray(m, nodes, candidates[m.name])}
    for name in sorted(pinned - set(room.splits)):  # vLLM over Ray: placed here, before whole copies
        m = next(x for x in models if x.name == name)
        if why := ray_copy(room, m, need[m.name], candidates[m.name]):
            unplaced[m.name] = why
    free = [m for m in models if m.name not in pinned]
    for m in free:  # first every copy already in place that still fits, so no new copy can push one out
        keep_held(room, m, need[m.name], candidates[m.name], current, wants[m.name])
    for m in free:  # then the missing copies
        want, cands = wants[m.name], candidates[m.name]
        got = add_copies(room, m, need[m.name], cands, want, lora_hosts(m, models))
        if got == 0 and want > 0 and can_split(m) and cands:
            if why := split_copy(
                room, m, need[m.name], cands, current, layers.get(m.name, 0)
            ):  # fits no single node: over several, if RPC servers together have the room
                unplaced[m.name] = f"0 of {want} copies fit ({need[m.name] // MB} MB each); no split either: {why}"
        elif why := shortfall(m, got, want, need[m.name], cands):
            unplaced[m.name] = why

    out = {
        n: Assignment(node_id=n, models=ms, rpc_peers=sorted(room.peers[n])) for n, ms in sorted(room.placed.items())
    }
    out.update(kept_for_return(models, nodes, current))
    return Plan(out, unplaced, room.splits, restaged)
