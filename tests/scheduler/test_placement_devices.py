"""Placement per device: each GPU is its own pool and the RAM another; copies are pinned to cards (`devices`)."""

from __future__ import annotations

import msgspec

from coderai.contracts import Assignment, GpuMemory, Heartbeat, ModelConfig
from coderai.scheduler.placement import plan
from coderai.sizing import UNKNOWN_CAPACITY, capacity, pools, runs_on_cpu
from coderai.testing.heartbeats import heartbeat

GB = 1 << 30


def hb(
    node: str = "n",
    gpus_gb: tuple[float, ...] = (),
    ram_gb: float = 64,
    budget_gb: float = 0,
    caps: tuple[str, ...] = ("llama", "llama-server", "embed", "vllm", "whisper", "tts"),
) -> Heartbeat:
    cards = [GpuMemory(total=int(g * GB), free=int(g * GB)) for g in gpus_gb]
    return heartbeat(
        node,
        caps,
        mem_total=int(ram_gb * GB),
        mem_free=int(ram_gb * GB),
        gpus=len(cards),
        vram_total=sum(c.total for c in cards),
        vram_free=sum(c.free for c in cards),
        gpu_memory=cards,
        mem_budget=int(budget_gb * GB),
    )


def model(name: str, gb: float, engine: str = "llama-server", replicas: int = 1, **kw) -> ModelConfig:
    return ModelConfig(
        name=name, engine=engine, path=f"/nonexistent/{name}.gguf", memory_mb=int(gb * 1024), replicas=replicas, **kw
    )


def copies(p, node: str = "n") -> dict[str, list[int]]:
    return {m.name: m.devices for m in p.assignments[node].models}


def test_two_cards_of_different_sizes_take_the_big_model_on_the_big_card_whatever_the_order():
    nodes = {"n": hb(gpus_gb=(8, 24))}  # 7.2 and 21.6 GB usable
    for order in ([model("small", 6), model("big", 18)], [model("big", 18), model("small", 6)]):
        p = plan(order, nodes)
        assert copies(p) == {"small": [0], "big": [1]} and p.unplaced == {}


def test_a_model_that_fits_no_single_card_but_both_gets_both():
    p = plan([model("huge", 30)], {"n": hb(gpus_gb=(16, 24))})  # 14.4 + 21.6 GB
    assert copies(p) == {"huge": [0, 1]} and p.unplaced == {}
    p = plan([model("huge", 40)], {"n": hb(gpus_gb=(16, 24))})
    assert copies(p) == {} and "huge" in p.unplaced
    # a family that cannot cut a model over cards does not get both
    assert (
        copies(plan([model("emb", 30, engine="embed", params={"device": "cuda"})], {"n": hb(gpus_gb=(16, 24))})) == {}
    )


def test_cards_already_holding_a_copy_are_shared_by_what_they_have_left():
    p = plan([model("a", 10), model("huge", 18)], {"n": hb(gpus_gb=(16, 16))})  # 14.4 GB each: 4.4 + 14.4 left
    assert copies(p) == {"a": [0], "huge": [0, 1]}


def test_a_cpu_model_takes_ram_and_no_vram_so_a_gpu_model_still_fits_beside_it():
    nodes = {"n": hb(gpus_gb=(8,), ram_gb=64)}
    cpu_models = [
        model("cpu-llama", 7, params={"n_gpu_layers": 0}),
        model("on-cpu", 7, params={"device": "cpu"}),
        model("emb", 7, engine="embed"),
        model("asr", 7, engine="whisper"),
        model("voice", 7, engine="tts"),
    ]
    p = plan(cpu_models + [model("gpu", 7)], nodes)
    assert copies(p) == {"cpu-llama": [], "on-cpu": [], "emb": [], "asr": [], "voice": [], "gpu": [0]}
    assert p.unplaced == {}
    assert runs_on_cpu(cpu_models[0]) and not runs_on_cpu(model("gpu", 1))
    assert not runs_on_cpu(model("e", 1, engine="embed", params={"device": "cuda:0"}))


def test_on_a_node_without_gpus_every_model_takes_ram():
    p = plan([model("a", 20), model("b", 20), model("c", 20)], {"n": hb(ram_gb=50)})  # 45 GB
    assert copies(p) == {"a": [], "b": []} and "c" in p.unplaced


def test_the_memory_budget_caps_what_models_take_of_the_ram():
    nodes = {"n": hb(ram_gb=64, budget_gb=3)}
    assert pools(nodes["n"]).ram == 3 * GB and capacity(nodes["n"]) == 3 * GB
    p = plan([model("a", 2), model("b", 2)], nodes)
    assert copies(p) == {"a": []} and "b" in p.unplaced
    # the budget is RAM only: a GPU model goes on its card whatever the budget
    p = plan([model("cpu", 2.5, params={"n_gpu_layers": 0}), model("gpu", 6)], {"n": hb(gpus_gb=(8,), budget_gb=3)})
    assert copies(p) == {"cpu": [], "gpu": [0]}


def test_devices_are_sticky_across_replans():
    nodes = {"n": hb(gpus_gb=(24, 24))}
    a, b = model("a", 4), model("b", 4)
    first = plan([a, b], nodes)
    assert copies(first) == {"a": [0], "b": [1]}  # two equal cards: spread over them
    moved = {
        "n": Assignment(
            node_id="n", models=[msgspec.structs.replace(a, devices=[1]), msgspec.structs.replace(b, devices=[0])]
        )
    }
    again = plan([a, b], nodes, moved)
    assert copies(again) == {"a": [1], "b": [0]}  # where they are, not where a fresh plan would put them
    assert plan([a, b], nodes, first.assignments).assignments == first.assignments
    assert copies(plan([model("a", 20), b], nodes, moved)) == {"a": [1], "b": [0]}  # grown, still held by its card
    assert copies(plan([model("a", 22), b], nodes, moved)) == {"a": [0, 1], "b": [0]}  # too big for it: both cards
    too_big = plan(
        [model("a", 20), model("b", 20)],
        nodes,
        {
            "n": Assignment(
                node_id="n", models=[msgspec.structs.replace(a, devices=[0]), msgspec.structs.replace(b, devices=[0])]
            )
        },
    )
    assert copies(too_big) == {"a": [0], "b": [1]}  # b cannot stay beside a: it moves to the free card


def test_binpack_fills_the_fuller_of_two_equal_cards():
    nodes = {"n": hb(gpus_gb=(24, 24))}
    ms = [model(x, 4, placement="binpack") for x in "abc"]
    assert copies(plan(ms, nodes)) == {"a": [0], "b": [0], "c": [0]}


def test_a_vllm_model_takes_one_card_per_rank():
    nodes = {"n": hb(gpus_gb=(24, 24, 24))}
    p = plan([model("v", 30, engine="vllm", params={"tensor_parallel_size": 2})], nodes)
    assert copies(p) == {"v": [0, 1]}


def test_a_gone_node_keeps_the_cards_of_its_everywhere_models():
    m = model("every", 4, replicas=0)
    p = plan(
        [m], {"other": hb("other")}, {"n": Assignment(node_id="n", models=[msgspec.structs.replace(m, devices=[1])])}
    )
    assert p.assignments["n"].models[0].devices == [1]


def test_a_node_reporting_only_totals_takes_gpu_models_unpinned_and_one_reporting_nothing_anything():
    totals = Heartbeat(node_id="n", version="0", seq=1, ts=0.0, host="n", capabilities=["llama"], vram_total=10 * GB)
    p = plan([model("m", 8, engine="llama")], {"n": totals})
    assert copies(p) == {"m": []} and p.unplaced == {}
    bare = Heartbeat(node_id="n", version="0", seq=1, ts=0.0, host="n", capabilities=["llama"])
    assert capacity(bare) == UNKNOWN_CAPACITY
    assert copies(plan([model("m", 10_000, engine="llama")], {"n": bare})) == {"m": []}


def test_an_rpc_split_counts_against_ram_not_the_cards():
    from coderai.contracts.split import RpcServer

    rpc = RpcServer(endpoint="10.0.0.2:50052", mem_total=32 * GB, mem_free=32 * GB)
    nodes = {
        "a": hb("a", gpus_gb=(8,), ram_gb=16, caps=("llama",)),
        "b": msgspec.structs.replace(hb("b", ram_gb=32, caps=("llama",)), rpc=rpc),
    }
    p = plan([model("big", 30, engine="llama", nodes=["a"])], nodes)
    assert p.splits["big"][0] == "a" and sum(d.share for d in p.splits["big"][1].devices) > 0.99
    assert p.assignments["a"].models[0].devices == []  # on the CPU and the RPC servers: no card


def test_cards_that_are_gone_from_the_node_are_not_kept():
    a = model("a", 4)
    held = {"n": Assignment(node_id="n", models=[msgspec.structs.replace(a, devices=[3])])}
    assert copies(plan([a], {"n": hb(gpus_gb=(24, 24))}, held)) == {"a": [0]}


def test_a_copy_goes_to_a_node_that_already_has_its_files():
    from coderai.contracts import Heartbeat, ModelConfig
    from coderai.scheduler.placement import plan

    def hb(node_id: str, stored: list[str]) -> Heartbeat:
        return Heartbeat(
            node_id=node_id,
            version="t",
            seq=1,
            ts=0.0,
            host=node_id,
            capabilities=["llama"],
            mem_total=8 << 30,
            mem_free=8 << 30,
            stored=stored,
        )

    m = ModelConfig(
        name="m", engine="llama", path="/nowhere/m.gguf", store_path="org/m.gguf", memory_mb=100, replicas=1
    )
    folder = ModelConfig(
        name="f", engine="llama", path="/nowhere/f", store_path="org/f/", store_file="f.gguf", memory_mb=100, replicas=1
    )
    # by name n1 would come first, and n2 holds fewer models after m: the files decide
    nodes = {"n1": hb("n1", []), "n2": hb("n2", ["org/m.gguf"]), "n3": hb("n3", ["org/f/f.gguf", "org/f/tok.json"])}
    got = plan([m, folder], nodes)
    assert [x.name for x in got.assignments["n2"].models] == ["m"]
    assert [x.name for x in got.assignments["n3"].models] == ["f"]
