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
    room: dict[str, Pools] = {n: pools(hb) for n, hb in nodes.items()}
    cards = {n: list(r.gpus) for n, r in room.items()}  # each card's full room, to prefer the smallest that holds

    def on_gpu(m: ModelConfig, n: str) -> bool:
        return bool(room[n].gpus) and not runs_on_cpu(m)

    def biggest(m: ModelConfig, n: str) -> int:
        """The most one pool of `n` offers `m` (a video cannot be cut over cards)."""
        return max(room[n].gpus) if on_gpu(m, n) else room[n].ram

    # a video model that fits no node whole is relayed by stages when its biggest part fits one (the gateway
    # learns it from the config the scheduler publishes: `restaged`)
    need: dict[str, int] = {}
    restaged: dict[str, ModelConfig] = {}
    sized: list[ModelConfig] = []
    for m in models:
        if staged(m) and not m.memory_mb:
            need[m.name] = largest_part(m)
        else:
            need[m.name] = estimate_bytes(m, sizes.get(m.name))
            roomiest = max((biggest(m, n) for n in nodes), default=0)
            if m.engine == "video" and not m.memory_mb and nodes and need[m.name] > roomiest:
                part = largest_part(m)
                if part <= roomiest:
                    m = restaged[m.name] = msgspec.structs.replace(m, params={**m.params, "stages": True})
                    need[m.name] = part
        sized.append(m)
    models = sized
    placed: dict[str, list[ModelConfig]] = {n: [] for n in nodes}
    unplaced: dict[str, str] = {}

    def eligible(m: ModelConfig, n: str) -> bool:
        return m.engine in nodes[n].capabilities and (not m.nodes or n in m.nodes) and (m.name, n) not in exclude

    def shared(b: int, n: str, devs: list[int]) -> Take | None:
        """`b` bytes over the cards `devs` of `n` by their room (llama.cpp's tensor split), if they hold it."""
        free = room[n].gpus
        total = sum(max(0, free[i]) for i in devs)
        if total < b:
            return None
        return {i: b * max(0, free[i]) // total for i in devs} if len(devs) > 1 else {devs[0]: b}

    def take(m: ModelConfig, n: str, keep: list[int] | None = None) -> Take | None:
        """The pools one copy of `m` takes on `n` (`keep`: the cards it holds now, kept while they hold it)."""
        r, b = room[n], need[m.name]
        if not on_gpu(m, n):
            return {RAM: b} if r.ram >= b else None
        if not r.indexed:  # a node that reported only its total: one pool, no card to pin
            return {0: b} if r.gpus[0] >= b else None
        ranks = world_size(m) if m.engine == "vllm" else 1
        if keep and all(0 <= i < len(r.gpus) for i in keep):
            if ranks == 1 and (got := shared(b, n, keep)) is not None:
                return got
            if ranks > 1 and len(keep) == ranks and all(r.gpus[i] >= b // ranks for i in keep):
                return {i: b // ranks for i in keep}
        if ranks > 1:  # vLLM: one card per rank, an equal share on each
            ok = sorted((i for i, f in enumerate(r.gpus) if f >= b // ranks), key=lambda i: (-r.gpus[i], i))
            return {i: b // ranks for i in sorted(ok[:ranks])} if len(ok) >= ranks else None
        whole = [i for i, f in enumerate(r.gpus) if f >= b]
        if whole:
            sign = 1 if m.placement == "binpack" else -1
            return {min(whole, key=lambda i: (cards[n][i], sign * r.gpus[i], i)): b}
        if m.engine not in GGUF_FAMILIES:
            return None
        chosen: list[int] = []
        for i in sorted(range(len(r.gpus)), key=lambda i: (-r.gpus[i], i)):
            if r.gpus[i] <= 0:
                break
            chosen.append(i)
            if (got := shared(b, n, sorted(chosen))) is not None:
                return got
        return None

    def use(n: str, t: Take) -> None:
        for pool, b in t.items():
            if pool == RAM:
                room[n].ram -= b
            else:
                room[n].gpus[pool] -= b

    def put(m: ModelConfig, n: str, t: Take) -> None:
        devices = sorted(t) if room[n].indexed and RAM not in t else []
        placed[n].append(m if devices == m.devices else msgspec.structs.replace(m, devices=devices))
        use(n, t)

    def has(n: str, name: str) -> bool:
        return any(x.name == name for x in placed[n])

    def free_for(m: ModelConfig, n: str) -> int:
        """The room `m` could use on `n` in all (its pool kind), to rank nodes by."""
        return sum(room[n].gpus) if on_gpu(m, n) else room[n].ram

    candidates = {m.name: sorted(n for n in nodes if eligible(m, n)) for m in models}
    wants = {m.name: len(candidates[m.name]) if m.replicas == 0 else m.replicas for m in models}
    wants = {m.name: min(wants[m.name], m.max_replicas) if m.max_replicas else wants[m.name] for m in models}
    splits: dict[str, tuple[str, SplitPlan]] = {}
    peers: dict[str, set[str]] = {n: set() for n in nodes}
    rpc_used: set[str] = set()

    def split(m: ModelConfig) -> str:
        """Place `m` as one split copy (on the serving node's CPU and the RPC servers: RAM); "" on success, else
        why not."""
        now = next(((n, x.shards) for n, a in current.items() for x in a.models if x.name == m.name and x.shards), ("", None))
        ram = {n: r.ram for n, r in room.items()}
        got = place_split(m, need[m.name], candidates[m.name], nodes, ram, now[1], now[0], layers.get(m.name, 0), rpc_used)
        if not isinstance(got, Split):
            return got
        placed[got.serving].append(msgspec.structs.replace(m, shards=got.plan))
        for n, b in got.takes.items():
            use(n, {RAM: b})
        for d in got.plan.remote():
            peers[d.node_id].update(gate_peers(nodes[got.serving], d.endpoint))
            rpc_used.add(d.node_id)
        splits[m.name] = (got.serving, got.plan)
        return ""

    def over_ray(m: ModelConfig) -> str:
        """Place `m` over several nodes' vLLM ranks; "" on success, else why not."""
        got = place_ray(m, need[m.name], candidates[m.name], nodes, {n: free_for(m, n) for n in nodes})
        if not isinstance(got, Split):
            return got
        for d in got.plan.devices:  # every node of the plan runs a part: the serving one, the others join its Ray
            placed[d.node_id].append(msgspec.structs.replace(m, shards=got.plan))
            gpus = room[d.node_id].gpus
            ranks = sorted(range(len(gpus)), key=lambda i: (-gpus[i], i))[: max(1, d.ranks)]
            use(d.node_id, {i: got.takes[d.node_id] // len(ranks) for i in ranks} if on_gpu(m, d.node_id)
                else {RAM: got.takes[d.node_id]})
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
        held = {n: x for n in candidates[m.name] for x in current.get(n, Assignment(node_id=n)).models if x.name == m.name}
        for n in list(held)[: wants[m.name]]:
            if (t := take(m, n, held[n].devices)) is not None:
                put(m, n, t)
    for m in models:  # then the missing copies
        if m.name in pinned:
            continue
        want = wants[m.name]
        have = [n for n in candidates[m.name] if has(n, m.name)]
        rest = [n for n in candidates[m.name] if n not in have and take(m, n) is not None]
        if m.placement == "binpack":
            rest.sort(key=lambda n: (fetch_first(m, nodes[n]), free_for(m, n), n))
        else:
            rest.sort(key=lambda n: (fetch_first(m, nodes[n]), len(placed[n]), -free_for(m, n), n))
        for n in rest[: max(0, want - len(have))]:
            put(m, n, take(m, n))  # type: ignore[arg-type]
        got = sum(has(n, m.name) for n in candidates[m.name])
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
    for n, a in current.items():  # gone nodes: keep the everywhere-models (on their cards) for when they come back
        if n not in nodes:
            keep = [msgspec.structs.replace(by_name[x.name], devices=x.devices) for x in a.models
                    if x.name in by_name and by_name[x.name].replicas == 0]
            out[n] = Assignment(node_id=n, models=keep)
    return Plan(out, unplaced, splits, restaged)
