"""The steps `placement.plan` is made of, one at a time: each is a small function over plain data (`Room` is one
pass's state, handed in explicitly)."""

from __future__ import annotations

import msgspec

from coderai.contracts import Assignment, GpuMemory, Heartbeat, ModelConfig
from coderai.contracts.split import RpcServer
from coderai.scheduler.placement import (
    RAM,
    Room,
    add_copies,
    biggest,
    eligible,
    free_for,
    holds,
    keep_held,
    kept_for_return,
    lora_hosts,
    on_gpu,
    put,
    ray_copy,
    shared,
    shortfall,
    sized,
    split_copy,
    plan,
    take,
    use,
    wanted,
)
from coderai.sizing import MB, OVERHEAD, Pools
from coderai.testing.heartbeats import heartbeat

GB = 1 << 30


def hb(
    node: str = "n", gpus_gb: tuple[float, ...] = (), ram_gb: float = 64, caps: tuple[str, ...] = ("llama",), **kw
) -> Heartbeat:
    cards = [GpuMemory(total=int(g * GB), free=int(g * GB)) for g in gpus_gb]
    return heartbeat(
        node,
        caps,
        mem_total=int(ram_gb * GB),
        gpus=len(cards),
        vram_total=sum(c.total for c in cards),
        gpu_memory=cards,
        **kw,
    )


def model(name: str = "m", gb: float = 1, engine: str = "llama", **kw) -> ModelConfig:
    return ModelConfig(name=name, engine=engine, path=f"/nonexistent/{name}.gguf", memory_mb=int(gb * 1024), **kw)


def test_a_room_starts_with_every_node_at_full_room_and_holding_nothing():
    room = Room.of({"a": hb("a", gpus_gb=(10,), ram_gb=10), "b": hb("b")})
    assert room.free["a"] == Pools(int(10 * GB * 0.9), [int(10 * GB * 0.9)], True)
    assert room.full == {"a": [int(10 * GB * 0.9)], "b": []}
    assert room.placed == {"a": [], "b": []} and room.peers == {"a": set(), "b": set()}
    assert room.splits == {} and room.rpc_used == set()


def test_on_gpu_biggest_and_free_for_read_the_pool_kind_the_copy_runs_on():
    r = Pools(ram=100, gpus=[30, 50], indexed=True)
    gpu, cpu = model(), model(params={"n_gpu_layers": 0})
    assert on_gpu(gpu, r) and not on_gpu(cpu, r) and not on_gpu(gpu, Pools(100, [], False))
    assert biggest(gpu, r) == 50 and biggest(cpu, r) == 100
    assert free_for(gpu, r) == 80 and free_for(cpu, r) == 100


def test_sized_measures_each_model_and_restages_a_video_that_fits_only_by_parts(tmp_path):
    for part, mb in (("text_encoder", 1000), ("unet", 2000), ("vae", 500)):
        (tmp_path / "v" / part).mkdir(parents=True)
        with open(tmp_path / "v" / part / "model.safetensors", "wb") as f:
            f.truncate(mb * MB)
    video = ModelConfig(name="v", engine="video", path=str(tmp_path / "v"))
    nodes = {"a": hb("a", ram_gb=4, caps=("video",))}
    models, need, restaged = sized([model("m", 2), video], nodes, {})
    assert need["m"] == 2 * GB and need["v"] == int(2000 * MB * 1.2) + OVERHEAD
    assert restaged["v"].params["stages"] is True and models[1] is restaged["v"] and models[0].name == "m"
    models, need, restaged = sized([video], {"a": hb("a", ram_gb=16, caps=("video",))}, {})
    assert restaged == {} and models == [video] and need["v"] == int(3500 * MB * 1.2) + OVERHEAD
    _, need, _ = sized([model("s", 0)], nodes, {"s": 1000 * MB})  # a file size given is taken as read
    assert need["s"] == int(1000 * MB * 1.2) + OVERHEAD


def test_eligible_is_the_engine_family_the_named_nodes_and_not_excluded():
    n = hb("a")
    assert eligible(model(), "a", n, frozenset())
    assert not eligible(model(engine="whisper"), "a", n, frozenset())
    assert not eligible(model(nodes=["b"]), "a", n, frozenset()) and eligible(model(nodes=["a"]), "a", n, frozenset())
    assert not eligible(model(), "a", n, {("m", "a")})


def test_wanted_is_replicas_or_every_candidate_capped_by_max_replicas():
    assert wanted(model(replicas=2), ["a"]) == 2
    assert wanted(model(replicas=0), ["a", "b", "c"]) == 3
    assert wanted(model(replicas=0, max_replicas=2), ["a", "b", "c"]) == 2
    assert wanted(model(replicas=5, max_replicas=2), ["a"]) == 2


def test_shared_splits_bytes_over_cards_by_their_room_or_says_they_do_not_hold_it():
    assert shared(30, [10, 20, 99], [0, 1]) == {0: 10, 1: 20}
    assert shared(31, [10, 20], [0, 1]) is None
    assert shared(5, [10], [0]) == {0: 5}
    assert shared(10, [-5, 20], [0, 1]) == {0: 0, 1: 10}  # an overdrawn card offers nothing


def test_take_picks_ram_one_card_cards_together_or_nothing():
    r = Pools(ram=100, gpus=[30, 50], indexed=True)
    full = [30, 50]
    assert take(model(params={"n_gpu_layers": 0}), 80, r, full) == {RAM: 80}
    assert take(model(params={"n_gpu_layers": 0}), 101, r, full) is None
    assert take(model(), 20, r, full) == {0: 20}  # the smallest card that holds it
    assert take(model(), 40, r, full) == {1: 40}
    assert take(model(), 70, r, full) == {0: 26, 1: 43}  # llama.cpp: both cards, by their room
    assert take(model(engine="embed", params={"device": "cuda"}), 70, r, full) is None  # not cut over cards
    assert take(model(), 20, Pools(100, [30], False), [30]) == {0: 20}  # only a total: one pool


def test_take_keeps_the_cards_a_copy_holds_and_gives_vllm_one_card_per_rank():
    r = Pools(ram=100, gpus=[30, 50, 50], indexed=True)
    full = [30, 50, 50]
    assert take(model(), 20, r, full, keep=[2]) == {2: 20}
    assert take(model(), 20, r, full, keep=[7]) == {0: 20}  # a card that is gone is not kept
    vllm = model(engine="vllm", params={"tensor_parallel_size": 2})
    assert take(vllm, 60, r, full) == {1: 30, 2: 30}
    assert take(vllm, 60, r, full, keep=[0, 1]) == {0: 30, 1: 30}
    assert take(vllm, 120, r, full) is None


def test_binpack_takes_the_fullest_card_of_equal_size_spread_the_roomiest():
    r = Pools(ram=0, gpus=[40, 30], indexed=True)
    assert take(model(), 10, r, [50, 50]) == {0: 10}
    assert take(model(placement="binpack"), 10, r, [50, 50]) == {1: 10}


def test_use_takes_each_pool_its_bytes():
    r = Pools(ram=100, gpus=[30, 50], indexed=True)
    use(r, {RAM: 10, 1: 20})
    assert r == Pools(90, [30, 30], True)


def test_put_places_a_copy_on_its_cards_and_holds_sees_it():
    room = Room.of({"a": hb("a", gpus_gb=(10, 10))})
    put(room, model("m"), "a", {1: GB})
    assert holds(room, "a", "m") and not holds(room, "a", "x")
    assert room.placed["a"][0].devices == [1] and room.free["a"].gpus[1] == room.full["a"][1] - GB
    put(room, model("c", params={"n_gpu_layers": 0}), "a", {RAM: GB})
    assert room.placed["a"][1].devices == []


def test_split_copy_serves_from_one_node_over_rpc_servers_and_records_it():
    rpc = RpcServer(endpoint="10.0.0.2:50052", mem_total=32 * GB, mem_free=32 * GB)
    nodes = {"a": hb("a", ram_gb=16, addrs=["192.168.1.1"]), "b": hb("b", ram_gb=32, rpc=rpc)}
    room = Room.of(nodes)
    assert split_copy(room, model("big"), 30 * GB, ["a", "b"], {}, 0) == ""
    serving, plan = room.splits["big"]
    assert serving == "a" and room.placed["a"][0].shards == plan
    assert room.rpc_used == {"b"} and room.peers["b"] == {"192.168.1.1"}
    assert sum(room.free[n].ram for n in nodes) < sum(Room.of(nodes).free[n].ram for n in nodes)
    assert split_copy(Room.of(nodes), model("huge"), 100 * GB, ["a", "b"], {}, 0) != ""


def test_ray_copy_runs_a_part_on_every_node_of_the_plan():
    nodes = {n: hb(n, gpus_gb=(24,), caps=("vllm",)) for n in ("a", "b")}
    room = Room.of(nodes)
    m = model("v", engine="vllm", params={"tensor_parallel_size": 2})
    assert ray_copy(room, m, 20 * GB, ["a", "b"]) == ""
    assert [x.name for x in room.placed["a"]] == ["v"] and [x.name for x in room.placed["b"]] == ["v"]
    assert room.splits["v"][1].mode == "ray" and room.free["a"].gpus[0] == room.full["a"][0] - 10 * GB
    assert "ranks" in ray_copy(Room.of({"a": nodes["a"]}), m, 20 * GB, ["a"])


def test_keep_held_keeps_copies_in_place_that_still_fit_up_to_the_wanted_count():
    nodes = {n: hb(n, gpus_gb=(10, 10)) for n in ("a", "b", "c")}
    m = model("m", 2)
    current = {n: Assignment(node_id=n, models=[msgspec.structs.replace(m, devices=[1])]) for n in ("a", "b")}
    room = Room.of(nodes)
    keep_held(room, m, 2 * GB, ["a", "b", "c"], current, 1)
    assert [n for n in nodes if holds(room, n, "m")] == ["a"] and room.placed["a"][0].devices == [1]
    room = Room.of(nodes)
    keep_held(room, m, 20 * GB, ["a", "b", "c"], current, 2)  # grown past its cards: not kept
    assert not any(room.placed.values())


def test_add_copies_fills_the_missing_copies_by_spread_or_binpack():
    nodes = {"a": hb("a", ram_gb=10), "b": hb("b", ram_gb=20), "c": hb("c", ram_gb=1)}
    room = Room.of(nodes)
    assert add_copies(room, model("m", 2, replicas=2), 2 * GB, ["a", "b", "c"], 2) == 2
    assert holds(room, "b", "m") and holds(room, "a", "m") and not holds(room, "c", "m")  # c: no room
    room = Room.of(nodes)
    assert add_copies(room, model("m", 0.5, placement="binpack"), GB // 2, ["a", "b", "c"], 1) == 1
    assert holds(room, "c", "m")  # the fullest that fits
    room = Room.of(nodes)
    put(room, model("m"), "a", {RAM: GB})
    assert add_copies(room, model("m"), GB, ["a", "b"], 1) == 1 and not holds(room, "b", "m")  # has its one


def test_shortfall_says_why_a_model_has_fewer_copies():
    assert shortfall(model(), 2, 2, GB, ["a", "b"]) == ""
    assert shortfall(model(), 1, 2, GB, ["a", "b"]) == "1 of 2 copies fit (1024 MB each)"
    assert shortfall(model(), 0, 1, GB, []) == "no live node runs its engine family"
    assert (
        shortfall(model(nodes=["x", "y"]), 0, 1, GB, [])
        == "none of its nodes (x, y) is live and runs its engine family"
    )


def test_kept_for_return_holds_only_everywhere_models_of_gone_nodes_on_their_cards():
    every, one = model("every", replicas=0), model("one", replicas=1)
    current = {
        "gone": Assignment(node_id="gone", models=[msgspec.structs.replace(every, devices=[1]), one, model("removed")]),
        "live": Assignment(node_id="live", models=[every]),
    }
    out = kept_for_return([every, one], {"live": hb("live")}, current)
    assert list(out) == ["gone"] and [(x.name, x.devices) for x in out["gone"].models] == [("every", [1])]


def test_a_fine_tuned_vllm_model_goes_to_the_node_whose_server_of_its_base_can_load_its_adapter():
    """vLLM loads a fine-tuned model's adapter into a running server of its base (LoRA on) at run time: the copy
    goes to the node holding that server, though spread alone would pick the emptier node."""
    nodes = {n: hb(n, caps=("vllm",)) for n in ("a", "b")}
    base = model("tiny", engine="vllm", replicas=1, params={"enable_lora": True})
    tuned = [model(f"tiny:t{i}-1a2b3c4d", engine="vllm", replicas=1, params={"base": base.path}) for i in (1, 2)]
    other = model("solo", engine="vllm", replicas=1)  # a model of its own: spread as before
    assert lora_hosts(tuned[0], [base, *tuned, other]) == ["tiny", "tiny:t2-1a2b3c4d"]
    assert lora_hosts(base, [base, *tuned]) == [] and lora_hosts(other, [base, *tuned]) == []
    placed = plan([base, other, *tuned], nodes).assignments
    where = {m.name: n for n, a in placed.items() for m in a.models}
    assert where["tiny"] == where["tiny:t1-1a2b3c4d"] == where["tiny:t2-1a2b3c4d"] != where["solo"]
    no_lora = msgspec.structs.replace(base, params={})  # its server takes no adapters: no pull towards it
    assert lora_hosts(tuned[0], [no_lora, tuned[0]]) == []
