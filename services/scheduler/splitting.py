"""Pure split placement: one llama.cpp model over a serving node and other nodes' RPC servers.

Used by `placement.plan` for a llama model that fits no single node (unless its `split` is `off`), or whose
config names `rpc_nodes` (an operator's choice, honoured whenever one of those nodes offers an RPC server).

- The serving node is the eligible node with the most room, preferring one that is not among the RPC servers
  it could use (those are kept for the layers).
- Remote devices: the named RPC nodes, or (automatic) the RPC servers with the most room, added one by one
  until the devices together hold the model. A device offers the lesser of its node's unplaced room and what
  its RPC server reports free.
- Shares are proportional to what each device offers. Layers are handed out in the order llama.cpp uses:
  the first blocks stay on the serving node's CPU, the last ones go to the remote devices in order.
- An RPC server holds layers of one split model at a time: a ggml RPC server serves one client at a time.
- A split in place is kept while its devices are live (free memory moves every heartbeat; re-splitting on
  every wobble would reload the model each time).
- A row split over a link below 10 GbE (or of unknown speed) is allowed, with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass

from coderai.contracts import GGUF_FAMILIES, Heartbeat, ModelConfig
from coderai.contracts.split import SplitDevice, SplitPlan

FAST_LINK_GBPS = 10.0


@dataclass
class Split:
    serving: str
    plan: SplitPlan
    takes: dict[str, int]  # node -> bytes it now holds of this model


def wants_pinned_split(m: ModelConfig, nodes: dict[str, Heartbeat]) -> bool:
    """An operator named RPC nodes for this model and at least one of them offers an RPC server now."""
    return m.engine in GGUF_FAMILIES and m.split != "off" and any(n in nodes and nodes[n].rpc for n in m.rpc_nodes)


def can_split(m: ModelConfig) -> bool:
    return m.engine in GGUF_FAMILIES and m.split != "off"


def row_warning(m: ModelConfig) -> str:
    if m.split != "row":
        return ""
    if m.link_gbps <= 0:
        return "row split over a link of unknown speed: it moves activations every layer and needs 10 GbE or better"
    if m.link_gbps < FAST_LINK_GBPS:
        return f"row split over a {m.link_gbps:g} Gb/s link (< 10 GbE): expect it to be slower than a layer split"
    return ""


def gate_peers(serving: Heartbeat, endpoint: str) -> list[str]:
    """The addresses an RPC node's gate must admit for `serving` to reach it at `endpoint` (loopback too when the
    endpoint is on loopback: both on one machine)."""
    host = endpoint.rpartition(":")[0].strip("[]")
    local = ["127.0.0.1", "::1"] if host.startswith("127.") or host == "::1" else []
    return list(serving.addrs) + local


def _layers(shares: list[float], n_layers: int) -> list[list[int]]:
    """Contiguous block ranges per device, in device order, sizes proportional to the shares (largest remainder)."""
    if n_layers <= 0:
        return [[] for _ in shares]
    raw = [s * n_layers for s in shares]
    counts = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - counts[i], reverse=True)[: n_layers - sum(counts)]:
        counts[i] += 1
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def place_split(
    m: ModelConfig,
    need: int,
    candidates: list[str],
    nodes: dict[str, Heartbeat],
    free: dict[str, int],
    current: SplitPlan | None = None,
    current_node: str = "",
    n_layers: int = 0,
    taken: set[str] | frozenset[str] = frozenset(),
) -> Split | str:
    """A split for `m` (a `Split`), or why there is none (a message). `taken`: RPC nodes another split uses
    already (a ggml RPC server serves one client at a time)."""
    offers = {n: hb.rpc for n, hb in nodes.items() if hb.rpc is not None and n not in taken}
    pinned = [n for n in m.rpc_nodes if n in offers]
    pool = pinned if m.rpc_nodes else sorted(offers)
    if not candidates:
        return "no live node runs llama.cpp to serve it"
    if current is not None and current_node in candidates and all(d.node_id in pool for d in current.remote()):
        plan = SplitPlan(mode=current.mode, devices=current.devices, n_layers=current.n_layers, warning=row_warning(m))
        return Split(current_node, plan, {d.node_id: int(need * d.share) for d in current.devices})

    def room(n: str) -> int:
        rpc = offers[n]
        return max(0, min(free.get(n, 0), rpc.mem_free or free.get(n, 0)))

    outside = [n for n in candidates if n not in pool]  # keep the RPC servers for the layers
    serving = max(outside or candidates, key=lambda n: (free[n], n))
    remote_pool = sorted((n for n in pool if n != serving), key=lambda n: (-room(n), n))
    if not remote_pool:
        return "no other node offers an RPC server"
    chosen: list[str] = []
    total = max(0, free[serving])
    for n in remote_pool:
        if room(n) <= 0:
            continue
        if not m.rpc_nodes and total >= need:
            break
        chosen.append(n)
        total += room(n)
    if not chosen or total < need:
        have = ", ".join(f"{n} {room(n) >> 20} MB" for n in remote_pool)
        return f"needs {need >> 20} MB; {serving} has {max(0, free[serving]) >> 20} MB and the RPC servers ({have}) too little"
    offered = [max(0, free[serving])] + [room(n) for n in chosen]
    shares = [o / sum(offered) for o in offered]
    layers = _layers(shares, n_layers)
    devices = [SplitDevice(node_id=serving, share=round(shares[0], 4), layers=layers[0])] + [
        SplitDevice(node_id=n, endpoint=offers[n].endpoint, share=round(s, 4), layers=ls)
        for n, s, ls in zip(chosen, shares[1:], layers[1:])
    ]
    plan = SplitPlan(
        mode=m.split if m.split in ("layer", "row") else "layer",
        devices=devices,
        n_layers=n_layers,
        warning=row_warning(m),
    )
    return Split(serving, plan, {d.node_id: int(need * d.share) for d in devices})


# --- vLLM over Ray ----------------------------------------------------------------------------------------


RANKED = frozenset({"vllm", "sglang"})
"""Families that run one rank per card and can spread their ranks over several nodes."""


def world_size(m: ModelConfig) -> int:
    """Ranks the model asks for: tensor parallel x pipeline parallel (vLLM's and SGLang's own names); 1 for
    families that run on one card."""
    if m.engine == "vllm":
        return max(1, m.param_int("tensor_parallel_size") or 1) * max(1, m.param_int("pipeline_parallel_size") or 1)
    if m.engine == "sglang":
        return max(1, m.param_int("tp_size") or 1) * max(1, m.param_int("pp_size") or 1)
    return 1


def node_ranks(hb: Heartbeat) -> int:
    return max(1, hb.gpus)


def needs_ray(m: ModelConfig, nodes: dict[str, Heartbeat], candidates: list[str]) -> bool:
    """A vLLM or SGLang model with more ranks than any one of its nodes has."""
    return m.engine in RANKED and bool(candidates) and world_size(m) > max(node_ranks(nodes[n]) for n in candidates)


def place_ray(
    m: ModelConfig,
    need: int,
    candidates: list[str],
    nodes: dict[str, Heartbeat],
    free: dict[str, int],
    taken: set[str] | frozenset[str] = frozenset(),
) -> Split | str:
    """Nodes for one vLLM copy over Ray: the node with the most ranks (then room) heads it, the next ones join
    until the ranks add up; for SGLang, the fewest nodes with the same ranks each. Each node must hold its share
    of the weights (need x its ranks / world)."""
    world = world_size(m)
    pool = sorted((n for n in candidates if n not in taken), key=lambda n: (-node_ranks(nodes[n]), -free[n], n))
    if m.engine == "sglang":  # SGLang splits its ranks evenly: the fewest nodes that each hold world / nodes
        chosen = _even(world, need, pool, nodes, free)
    else:
        chosen = []
        left = world
        for n in pool:
            if left <= 0:
                break
            r = min(node_ranks(nodes[n]), left)
            if free[n] < need * r // world:
                continue
            chosen.append((n, r))
            left -= r
    if sum(r for _, r in chosen) < world:
        label = "SGLang" if m.engine == "sglang" else "vLLM"
        have = sum(r for _, r in chosen) if m.engine != "sglang" else len(chosen)
        even = " (as many on each node)" if m.engine == "sglang" else ""
        return f"needs {world} {label} ranks{even}; the nodes with room have {have}"
    devices = [
        SplitDevice(node_id=n, endpoint=(nodes[n].addrs or [""])[0], share=round(r / world, 4), ranks=r)
        for n, r in chosen
    ]
    plan = SplitPlan(mode="ranks" if m.engine == "sglang" else "ray", devices=devices)
    return Split(chosen[0][0], plan, {n: need * r // world for n, r in chosen})


def _even(
    world: int, need: int, pool: list[str], nodes: dict[str, Heartbeat], free: dict[str, int]
) -> list[tuple[str, int]]:
    """The fewest nodes of `pool` that each run `world / count` ranks with room for that share ([] if none)."""
    for count in range(1, world + 1):
        if world % count:
            continue
        each = world // count
        fit = [n for n in pool if node_ranks(nodes[n]) >= each and free[n] >= need * each // world]
        if len(fit) >= count:
            return [(n, each) for n in fit[:count]]
    return []
