"""Split placement is pure: a llama model that fits no node is cut over a serving node and RPC servers by free
memory; one that names `rpc_nodes` is cut over those while they live and placed whole when they are gone."""

from __future__ import annotations

import msgspec

from coderai.contracts import Assignment, Heartbeat, ModelConfig
from coderai.contracts.split import RpcServer
from coderai.scheduler.placement import plan
from coderai.sizing import MB
from coderai.scheduler.splitting import _layers, gate_peers, row_warning
from coderai.testing.heartbeats import heartbeat


def hb(node: str, mem_mb: int, rpc: bool = False, caps: list[str] | None = None) -> Heartbeat:
    """A node with `mem_mb` of RAM (90 % usable), optionally offering an RPC server with the same free memory."""
    server = (
        RpcServer(endpoint=f"10.0.0.{ord(node[-1]) % 200}:50052", mem_total=mem_mb * MB, mem_free=mem_mb * MB)
        if rpc
        else None
    )
    return heartbeat(
        node,
        caps if caps is not None else ["llama"],
        mem_total=mem_mb * MB,
        addrs=[f"192.168.1.{ord(node[-1]) % 200}"],
        rpc=server,
    )


def model(name: str = "big", memory_mb: int = 10_000, **kw) -> ModelConfig:
    return ModelConfig(
        name=name, engine=kw.pop("engine", "llama"), path=f"/nonexistent/{name}", memory_mb=memory_mb, replicas=1, **kw
    )


def served(p, name: str) -> list[tuple[str, ModelConfig]]:
    return [(n, m) for n, a in p.assignments.items() for m in a.models if m.name == name]


def test_a_model_that_fits_no_node_is_split_by_free_memory_with_contiguous_layers():
    nodes = {"a": hb("a", 8_000), "b": hb("b", 4_000, rpc=True), "c": hb("c", 2_000, rpc=True)}
    p = plan([model(memory_mb=9_000)], nodes, layers={"big": 32})
    [(node, m)] = served(p, "big")
    assert node == "a" and "big" not in p.unplaced
    devices = m.shards.devices
    assert [d.node_id for d in devices] == ["a", "b"]  # b alone (the roomier RPC server) completes it; c is not needed
    assert devices[0].endpoint == "" and devices[1].endpoint == nodes["b"].rpc.endpoint
    assert abs(devices[0].share - 2 / 3) < 1e-3 and abs(devices[1].share - 1 / 3) < 1e-3
    assert devices[0].layers == list(range(0, 21)) and devices[1].layers == list(range(21, 32))
    assert p.assignments["b"].rpc_peers == ["192.168.1.97"] and p.assignments["a"].rpc_peers == []
    assert p.splits["big"][0] == "a" and p.splits["big"][1] == m.shards


def test_more_rpc_servers_are_added_until_the_model_fits_and_too_little_says_why():
    nodes = {"a": hb("a", 4_000), "b": hb("b", 4_000, rpc=True), "c": hb("c", 4_000, rpc=True)}
    [(_, m)] = served(plan([model(memory_mb=9_000)], nodes), "big")
    assert [d.node_id for d in m.shards.devices] == ["a", "b", "c"]
    p = plan([model(memory_mb=50_000)], nodes)
    assert served(p, "big") == []
    assert "0 of 1 copies fit" in p.unplaced["big"] and "RPC servers" in p.unplaced["big"]


def test_split_off_or_another_engine_family_is_never_split():
    nodes = {"a": hb("a", 4_000, caps=["llama", "vllm"]), "b": hb("b", 8_000, rpc=True)}
    assert served(plan([model(memory_mb=9_000, split="off")], nodes), "big") == []
    assert served(plan([model(memory_mb=9_000, engine="vllm")], nodes), "big") == []


def test_rpc_nodes_split_a_model_that_would_fit_and_it_goes_whole_when_they_are_gone():
    pinned = model(memory_mb=1_000, nodes=["a"], rpc_nodes=["b"])
    nodes = {"a": hb("a", 8_000), "b": hb("b", 8_000, rpc=True)}
    p = plan([pinned], nodes, layers={"big": 4})
    [(node, m)] = served(p, "big")
    assert node == "a" and [d.node_id for d in m.shards.devices] == ["a", "b"]
    assert [d.layers for d in m.shards.devices] == [[0, 1], [2, 3]]
    # b died: the same model, whole, on a; and b's gate admits nobody any more
    p2 = plan([pinned], {"a": nodes["a"]}, current={n: a for n, a in p.assignments.items()})
    [(node, m)] = served(p2, "big")
    assert node == "a" and m.shards is None and m == pinned


def test_a_split_in_place_is_kept_while_its_devices_live_though_free_memory_moves():
    nodes = {"a": hb("a", 8_000), "b": hb("b", 4_000, rpc=True)}
    first = plan([model(memory_mb=9_000)], nodes)
    moved = {"a": msgspec.structs.replace(nodes["a"], mem_total=9_000 * MB), "b": nodes["b"]}
    again = plan([model(memory_mb=9_000)], moved, current=first.assignments)
    assert served(again, "big") == served(first, "big")


def test_layers_are_handed_out_by_largest_remainder_and_sum_to_the_model():
    assert _layers([0.5, 0.25, 0.25], 5) == [[0, 1, 2], [3], [4]]
    assert _layers([0.9, 0.1], 3) == [[0, 1, 2], []]
    assert _layers([0.5, 0.5], 0) == [[], []]


def test_row_split_warns_below_10_gbe_or_unknown_link_and_gate_peers_cover_loopback():
    assert "unknown speed" in row_warning(model(split="row"))
    assert "1 Gb/s" in row_warning(model(split="row", link_gbps=1))
    assert row_warning(model(split="row", link_gbps=25)) == "" and row_warning(model()) == ""
    nodes = {"a": hb("a", 4_000), "b": hb("b", 8_000, rpc=True)}
    [(_, m)] = served(plan([model(memory_mb=9_000, split="row", link_gbps=1)], nodes), "big")
    assert m.shards.mode == "row" and "1 Gb/s" in m.shards.warning
    assert gate_peers(nodes["a"], "127.0.0.1:5") == ["192.168.1.97", "127.0.0.1", "::1"]
    assert gate_peers(nodes["a"], "10.0.0.2:5") == ["192.168.1.97"]


def test_assignments_without_splits_are_unchanged_in_shape():
    nodes = {"a": hb("a", 8_000)}
    p = plan([model(memory_mb=100)], nodes)
    assert p.assignments == {"a": Assignment(node_id="a", models=[model(memory_mb=100)])} and p.splits == {}


def test_an_rpc_server_holds_layers_of_one_split_model_at_a_time():
    nodes = {"a": hb("a", 8_000), "b": hb("b", 8_000, rpc=True), "c": hb("c", 8_000, rpc=True)}
    p = plan([model("m1", memory_mb=9_000), model("m2", memory_mb=9_000), model("m3", memory_mb=9_000)], nodes)
    remote = [m.shards.remote()[0].node_id for _, m in served(p, "m1") + served(p, "m2")]
    assert sorted(remote) == ["b", "c"]
    assert served(p, "m3") == [] and "RPC server" in p.unplaced["m3"]


# --- vLLM over Ray ------------------------------------------------------------------------------------


def vllm(tp: int = 1, pp: int = 1, memory_mb: int = 2_000) -> ModelConfig:
    return model(
        "v", memory_mb=memory_mb, engine="vllm", params={"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    )


def gpu_node(node: str, gpus: int, mem_mb: int = 64_000) -> Heartbeat:
    return msgspec.structs.replace(hb(node, mem_mb, caps=["vllm"]), gpus=gpus, vram_total=gpus * 24_000 * MB)


def test_a_vllm_model_with_more_ranks_than_any_node_is_planned_over_ray_on_every_node_it_needs():
    nodes = {"a": gpu_node("a", 2), "b": gpu_node("b", 4), "c": gpu_node("c", 1)}
    p = plan([vllm(tp=2, pp=3)], nodes)
    held = served(p, "v")
    assert sorted(n for n, _ in held) == ["a", "b"]  # 4 + 2 ranks; c is not needed
    shards = held[0][1].shards
    assert shards.mode == "ray" and [(d.node_id, d.ranks) for d in shards.devices] == [("b", 4), ("a", 2)]
    assert shards.devices[0].endpoint == "192.168.1.98"  # b heads Ray, on its cluster address
    assert all(m.shards == shards for _, m in held) and p.splits["v"][0] == "b"


def test_cpu_nodes_count_one_rank_and_a_model_that_fits_one_node_is_not_spread():
    nodes = {n: hb(n, 8_000, caps=["vllm"]) for n in ("a", "b")}
    [(_, m)] = served(plan([vllm()], nodes), "v")
    assert m.shards is None
    held = served(plan([vllm(pp=2)], nodes), "v")
    assert sorted(n for n, _ in held) == ["a", "b"] and held[0][1].shards.mode == "ray"
    p = plan([vllm(pp=3)], nodes)
    assert served(p, "v") == [] and "needs 3 vLLM ranks" in p.unplaced["v"]


# --- SGLang over nodes (--nnodes / --node-rank) --------------------------------------------------------------


def sglang(tp: int = 1, pp: int = 1) -> ModelConfig:
    return model("s", memory_mb=2_000, engine="sglang", params={"tp_size": tp, "pp_size": pp})


def sglang_node(node: str, gpus: int) -> Heartbeat:
    return msgspec.structs.replace(hb(node, 64_000, caps=["sglang"]), gpus=gpus, vram_total=gpus * 24_000 * MB)


def test_an_sglang_model_is_spread_evenly_over_the_fewest_nodes_that_hold_its_ranks():
    nodes = {"a": sglang_node("a", 2), "b": sglang_node("b", 2), "c": sglang_node("c", 1)}
    p = plan([sglang(tp=4)], nodes)  # 4 ranks: two nodes of 2 (c's one card would make it uneven)
    held = served(p, "s")
    assert sorted(n for n, _ in held) == ["a", "b"]
    shards = held[0][1].shards
    assert shards.mode == "ranks" and [d.ranks for d in shards.devices] == [2, 2]
    assert all(m.shards == shards for _, m in held) and p.splits["s"][0] == shards.devices[0].node_id


def test_sglang_ranks_that_cannot_be_even_are_not_placed_and_say_why():
    nodes = {"a": sglang_node("a", 2), "b": sglang_node("b", 2)}
    p = plan([sglang(tp=3)], nodes)  # 3 ranks: one node of 3 or three of 1; there are two nodes of 2
    assert served(p, "s") == [] and "needs 3 SGLang ranks (as many on each node)" in p.unplaced["s"]
    [(_, m)] = served(plan([sglang(tp=2)], nodes), "s")  # fits one node: not spread
    assert m.shards is None
