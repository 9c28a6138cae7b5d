"""Placement is pure: models go to nodes whose engine families run them, that they name, and that have room."""

from __future__ import annotations


from coderai.contracts import Assignment, Heartbeat, ModelConfig
from coderai.scheduler.placement import Plan, plan
from coderai.sizing import MB, OVERHEAD, UNKNOWN_CAPACITY, capacity, estimate_bytes
from coderai.testing.heartbeats import heartbeat

GB = 1 << 30


def hb(node: str, caps: list[str] | None = None, mem_mb: int = 0, vram_mb: int = 0) -> Heartbeat:
    return heartbeat(node, caps if caps is not None else ["llama"], mem_total=mem_mb * MB, vram_total=vram_mb * MB)


def model(
    name: str,
    engine: str = "llama",
    nodes: list[str] | None = None,
    replicas: int = 0,
    placement: str = "spread",
    memory_mb: int = 0,
    path: str | None = None,
) -> ModelConfig:
    return ModelConfig(
        name=name,
        engine=engine,
        path=path or f"/nonexistent/{name}",
        nodes=nodes or [],
        replicas=replicas,
        placement=placement,
        memory_mb=memory_mb,
    )


def names(a: Assignment) -> list[str]:
    return [m.name for m in a.models]


def holders(p: Plan, name: str) -> list[str]:
    return sorted(n for n, a in p.assignments.items() if name in names(a))


def current(**held: list[ModelConfig]) -> dict[str, Assignment]:
    return {n: Assignment(node_id=n, models=ms) for n, ms in held.items()}


# --- estimate_bytes ---------------------------------------------------------------------------------


def test_memory_mb_wins_over_any_file_size():
    assert estimate_bytes(model("m", memory_mb=3000), file_size=50 * GB) == 3000 * MB


def test_a_given_file_size_counts_one_point_two_times_plus_overhead():
    assert OVERHEAD == 256 * MB
    assert estimate_bytes(model("m"), file_size=1000 * MB) == int(1000 * MB * 1.2) + 256 * MB


def test_a_zero_file_size_is_taken_as_given_not_looked_up(tmp_path):
    f = tmp_path / "w.gguf"
    f.write_bytes(b"x" * 10_000)
    assert estimate_bytes(model("m", path=str(f)), file_size=0) == OVERHEAD


def test_without_a_size_the_real_file_is_measured(tmp_path):
    f = tmp_path / "w.gguf"
    f.write_bytes(b"x" * 10_000)
    assert estimate_bytes(model("m", path=str(f))) == 12_000 + OVERHEAD


def test_a_home_relative_path_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "w.gguf").write_bytes(b"x" * 5_000)
    assert estimate_bytes(model("m", path="~/w.gguf")) == 6_000 + OVERHEAD


def test_a_file_only_the_nodes_have_counts_the_overhead_alone(tmp_path):
    assert estimate_bytes(model("m", path=str(tmp_path / "absent.gguf"))) == OVERHEAD


def test_plan_uses_sizes_by_model_name_instead_of_the_disk():
    nodes = {"n": hb("n", vram_mb=10_000)}  # offers 9,000 MB
    small = plan([model("m", replicas=1)], nodes, sizes={"m": 7000 * MB})  # 8,400 + 256 MB fits
    big = plan([model("m", replicas=1)], nodes, sizes={"m": 7400 * MB})  # 8,880 + 256 MB does not
    assert holders(small, "m") == ["n"] and small.unplaced == {}
    assert holders(big, "m") == [] and "m" in big.unplaced


# --- capacity ---------------------------------------------------------------------------------------


def test_capacity_is_ninety_percent_of_vram_when_reported():
    assert capacity(hb("n", mem_mb=64_000, vram_mb=24_000)) == int(24_000 * MB * 0.9)


def test_capacity_falls_back_to_ram_without_vram():
    assert capacity(hb("n", mem_mb=16_000)) == int(16_000 * MB * 0.9)


def test_a_node_reporting_no_memory_is_never_refused():
    assert capacity(hb("n")) == UNKNOWN_CAPACITY
    p = plan([model("huge", replicas=1, memory_mb=10_000_000)], {"n": hb("n")})
    assert holders(p, "huge") == ["n"] and p.unplaced == {}


# --- the intentions kept from before memory fit ------------------------------------------------------


def test_no_nodes_means_an_empty_plan_and_the_model_unplaced():
    p = plan([model("a")], {})
    assert p.assignments == {}
    assert "engine family" in p.unplaced["a"]


def test_no_models_gives_every_node_an_empty_assignment():
    p = plan([], {"n1": hb("n1"), "n2": hb("n2", caps=[])})
    assert p == Plan({"n1": Assignment(node_id="n1", models=[]), "n2": Assignment(node_id="n2", models=[])}, {})


def test_everywhere_models_go_to_every_node_with_the_engine_family():
    models = [model("chat", "llama"), model("emb", "embed"), model("img", "diffusers")]
    nodes = {"gpu": hb("gpu", ["llama", "diffusers"]), "cpu": hb("cpu", ["embed", "llama"]), "bare": hb("bare", [])}
    p = plan(models, nodes)
    assert set(p.assignments) == {"gpu", "cpu", "bare"}
    assert all(p.assignments[n].node_id == n for n in p.assignments)
    assert names(p.assignments["gpu"]) == ["chat", "img"]
    assert names(p.assignments["cpu"]) == ["chat", "emb"]
    assert names(p.assignments["bare"]) == []
    assert p.unplaced == {}


def test_assigned_models_are_the_configs_themselves_in_file_order():
    models = [model("z"), model("a")]
    assert plan(models, {"n": hb("n")}).assignments["n"].models == models


def test_nodes_restricts_a_model_to_the_named_nodes():
    models = [model("pinned", nodes=["n2"]), model("everywhere")]
    p = plan(models, {n: hb(n) for n in ["n1", "n2", "n3"]})
    assert names(p.assignments["n1"]) == ["everywhere"]
    assert names(p.assignments["n2"]) == ["pinned", "everywhere"]
    assert names(p.assignments["n3"]) == ["everywhere"]


def test_a_named_node_without_the_capability_does_not_get_the_model():
    p = plan([model("pinned", "whisper", nodes=["n1"])], {"n1": hb("n1", ["llama"]), "n2": hb("n2", ["whisper"])})
    assert holders(p, "pinned") == []
    assert "pinned" in p.unplaced


def test_a_model_naming_only_absent_nodes_goes_nowhere():
    p = plan([model("pinned", nodes=["gone"])], {"n1": hb("n1")})
    assert p.assignments == {"n1": Assignment(node_id="n1", models=[])}
    assert "pinned" in p.unplaced


def test_plan_is_keyed_in_sorted_node_order():
    nodes = {n: hb(n) for n in ["c", "a", "b"]}
    assert list(plan([model("m")], nodes).assignments) == ["a", "b", "c"]


# --- does it fit ------------------------------------------------------------------------------------


def test_a_model_bigger_than_every_node_goes_nowhere_and_says_why():
    nodes = {n: hb(n, vram_mb=10_000) for n in ["a", "b"]}
    p = plan([model("huge", replicas=1, memory_mb=20_000)], nodes)
    assert holders(p, "huge") == []
    assert set(p.assignments) == {"a", "b"}
    why = p.unplaced["huge"]
    assert "20000 MB" in why and "0 of 1" in why


def test_an_everywhere_model_lands_only_on_the_nodes_it_fits():
    nodes = {"big": hb("big", vram_mb=24_000), "small": hb("small", vram_mb=4_000), "ram": hb("ram", mem_mb=32_000)}
    p = plan([model("m", memory_mb=8_000)], nodes)
    assert holders(p, "m") == ["big", "ram"]
    assert "2 of 3" in p.unplaced["m"]


def test_vram_not_ram_decides_the_fit_on_a_gpu_node():
    p = plan([model("m", replicas=1, memory_mb=8_000)], {"n": hb("n", mem_mb=128_000, vram_mb=8_000)})
    assert holders(p, "m") == []  # 8,000 MB > 90 % of 8,000 MB, however much RAM there is


def test_a_model_needing_exactly_the_room_left_fits():
    nodes = {"n": hb("n", vram_mb=10_000)}
    assert capacity(nodes["n"]) == 9_000 * MB
    assert holders(plan([model("m", replicas=1, memory_mb=9_000)], nodes), "m") == ["n"]
    assert holders(plan([model("m", replicas=1, memory_mb=9_001)], nodes), "m") == []


# --- spread and binpack -----------------------------------------------------------------------------


def test_spread_goes_to_the_nodes_holding_fewest_models():
    models = [model("first", nodes=["a"], replicas=1, memory_mb=100), model("m", replicas=2, memory_mb=100)]
    nodes = {n: hb(n, vram_mb=10_000) for n in ["a", "b", "c"]}
    assert holders(plan(models, nodes), "m") == ["b", "c"]


def test_spread_breaks_ties_by_more_free_room():
    nodes = {"a": hb("a", vram_mb=8_000), "b": hb("b", vram_mb=24_000), "c": hb("c", vram_mb=16_000)}
    assert holders(plan([model("m", replicas=2, memory_mb=1_000)], nodes), "m") == ["b", "c"]


def test_spread_breaks_full_ties_by_node_id():
    nodes = {n: hb(n, vram_mb=10_000) for n in ["c", "b", "a"]}
    assert holders(plan([model("m", replicas=2, memory_mb=1_000)], nodes), "m") == ["a", "b"]


def test_spread_counts_free_room_after_earlier_models():
    nodes = {"a": hb("a", vram_mb=20_000), "b": hb("b", vram_mb=20_000), "c": hb("c", vram_mb=20_000)}
    models = [
        model("x", replicas=1, memory_mb=5_000),
        model("y", replicas=1, memory_mb=5_000),
        model("z", replicas=2, memory_mb=1_000),
    ]
    p = plan(models, nodes)
    assert (holders(p, "x"), holders(p, "y")) == (["a"], ["b"])
    # c holds nothing; a and b hold one each with equal room left, so the id decides
    assert holders(p, "z") == ["a", "c"]


def test_binpack_fills_the_fullest_node_that_still_fits():
    nodes = {
        "roomy": hb("roomy", vram_mb=40_000),
        "snug": hb("snug", vram_mb=10_000),
        "tiny": hb("tiny", vram_mb=2_000),
    }
    models = [model(f"m{i}", replicas=1, placement="binpack", memory_mb=4_000) for i in range(3)]
    p = plan(models, nodes)
    # snug offers 9,000 MB: two 4,000 MB copies, then it is too full and the third goes to roomy; tiny never fits
    assert names(p.assignments["snug"]) == ["m0", "m1"]
    assert names(p.assignments["roomy"]) == ["m2"]
    assert names(p.assignments["tiny"]) == []
    assert p.unplaced == {}


def test_binpack_ignores_how_many_models_a_node_holds():
    nodes = {"a": hb("a", vram_mb=10_000), "b": hb("b", vram_mb=20_000)}
    models = [
        model("x", nodes=["a"], replicas=1, memory_mb=1_000),
        model("y", replicas=1, placement="binpack", memory_mb=1_000),
    ]
    assert holders(plan(models, nodes), "y") == ["a"]  # spread would pick b, which holds nothing


def test_replicas_caps_the_number_of_copies():
    nodes = {n: hb(n, vram_mb=10_000) for n in ["a", "b", "c", "d"]}
    p = plan([model("one", replicas=1, memory_mb=100), model("two", replicas=2, memory_mb=100)], nodes)
    assert len(holders(p, "one")) == 1
    assert len(holders(p, "two")) == 2
    assert p.unplaced == {}


def test_more_replicas_than_nodes_places_one_per_node_and_reports_the_shortfall():
    nodes = {n: hb(n, vram_mb=10_000) for n in ["a", "b"]}
    p = plan([model("m", replicas=3, memory_mb=100)], nodes)
    assert holders(p, "m") == ["a", "b"]
    assert all(names(a).count("m") == 1 for a in p.assignments.values())
    assert "2 of 3" in p.unplaced["m"]


def test_nodes_pins_a_replicated_model_against_spread():
    nodes = {"a": hb("a", vram_mb=8_000), "b": hb("b", vram_mb=80_000)}
    p = plan([model("m", nodes=["a"], replicas=1, memory_mb=1_000)], nodes)
    assert holders(p, "m") == ["a"]


def test_a_pin_to_a_node_too_small_is_unplaced_not_moved():
    nodes = {"a": hb("a", vram_mb=4_000), "b": hb("b", vram_mb=80_000)}
    p = plan([model("m", nodes=["a"], replicas=1, memory_mb=8_000)], nodes)
    assert holders(p, "m") == []
    assert "m" in p.unplaced


# --- memory accounting across models ----------------------------------------------------------------


def test_two_models_that_fit_alone_but_not_together_on_the_only_node():
    nodes = {"n": hb("n", vram_mb=10_000)}  # 9,000 MB
    p = plan([model("x", memory_mb=5_000), model("y", memory_mb=5_000)], nodes)
    assert names(p.assignments["n"]) == ["x"]
    assert "y" in p.unplaced and "x" not in p.unplaced


def test_the_second_model_goes_elsewhere_when_the_first_filled_the_node():
    nodes = {"big": hb("big", vram_mb=10_000), "small": hb("small", vram_mb=6_000)}
    models = [
        model("x", replicas=1, placement="binpack", memory_mb=5_000),
        model("y", replicas=1, placement="binpack", memory_mb=5_000),
    ]
    p = plan(models, nodes)
    assert holders(p, "x") == ["small"]  # the fullest that fits
    assert holders(p, "y") == ["big"]  # small has 400 MB left
    assert p.unplaced == {}


def test_sizes_from_files_add_up_too():
    nodes = {"n": hb("n", mem_mb=4_000)}  # 3,600 MB
    p = plan([model("x", replicas=1), model("y", replicas=1)], nodes, sizes={"x": 1_000 * MB, "y": 1_500 * MB})
    # x needs 1,456 MB and y 2,056 MB: 3,512 MB in all
    assert names(p.assignments["n"]) == ["x", "y"]
    p = plan([model("x", replicas=1), model("y", replicas=1)], nodes, sizes={"x": 1_000 * MB, "y": 1_600 * MB})
    assert names(p.assignments["n"]) == ["x"] and "y" in p.unplaced


# --- sticky placement and nodes coming and going -----------------------------------------------------


def test_a_held_model_stays_where_it_is_even_if_spread_would_prefer_another_node():
    nodes = {"a": hb("a", vram_mb=80_000), "b": hb("b", vram_mb=8_000)}
    m = model("m", replicas=1, memory_mb=1_000)
    assert holders(plan([m], nodes), "m") == ["a"]
    assert holders(plan([m], nodes, current(b=[m])), "m") == ["b"]


def test_a_new_node_joining_moves_nothing():
    ms = [model("x", replicas=1, memory_mb=1_000), model("y", replicas=2, memory_mb=1_000), model("z", memory_mb=1_000)]
    nodes = {n: hb(n, vram_mb=10_000) for n in ["a", "b", "c"]}
    before = plan(ms, nodes)
    nodes["new"] = hb("new", vram_mb=80_000)
    after = plan(ms, nodes, before.assignments)
    for n in ["a", "b", "c"]:
        assert after.assignments[n] == before.assignments[n]
    assert names(after.assignments["new"]) == ["z"]  # only the everywhere-model reaches it


def test_a_config_change_reaches_a_sticky_holder():
    old = model("m", replicas=1, memory_mb=1_000)
    new = ModelConfig(
        name="m", engine="llama", path="/nonexistent/m", replicas=1, memory_mb=1_000, params={"n_ctx": 8192}
    )
    nodes = {"a": hb("a", vram_mb=80_000), "b": hb("b", vram_mb=8_000)}
    p = plan([new], nodes, current(b=[old]))
    assert p.assignments["b"].models == [new]


def test_a_held_model_that_no_longer_fits_moves():
    nodes = {"a": hb("a", vram_mb=40_000), "b": hb("b", vram_mb=4_000)}
    grown = model("m", replicas=1, memory_mb=8_000)
    p = plan([grown], nodes, current(b=[model("m", replicas=1, memory_mb=1_000)]))
    assert holders(p, "m") == ["a"]


def test_lowering_replicas_keeps_a_current_holder_and_adds_nothing():
    nodes = {n: hb(n, vram_mb=10_000) for n in ["a", "b", "c"]}
    two = model("m", replicas=2, memory_mb=1_000)
    one = model("m", replicas=1, memory_mb=1_000)
    p = plan([one], nodes, current(b=[two], c=[two]))
    assert len(holders(p, "m")) == 1 and holders(p, "m")[0] in ("b", "c")


def test_a_held_model_moves_off_a_node_no_longer_named():
    nodes = {n: hb(n, vram_mb=10_000) for n in ["a", "b"]}
    p = plan([model("m", nodes=["a"], replicas=1, memory_mb=1_000)], nodes, current(b=[model("m", replicas=1)]))
    assert holders(p, "m") == ["a"]


def test_a_leaving_node_hands_its_replicated_model_to_a_live_node():
    one = model("one", replicas=1, memory_mb=1_000)
    every = model("every", memory_mb=1_000)
    nodes = {n: hb(n, vram_mb=10_000) for n in ["b", "c"]}
    p = plan([one, every], nodes, current(a=[one, every], b=[every], c=[every]))
    assert len([n for n in holders(p, "one") if n in nodes]) == 1
    # the gone node keeps only the everywhere-models, ready for its return
    assert p.assignments["a"] == Assignment(node_id="a", models=[every])
    assert holders(p, "every") == ["a", "b", "c"]
    assert p.unplaced == {}


def test_a_gone_node_keeps_the_current_config_and_drops_removed_models():
    old = model("every", memory_mb=1_000)
    new = ModelConfig(name="every", engine="llama", path="/nonexistent/every", memory_mb=2_000)
    p = plan([new], {"b": hb("b", vram_mb=10_000)}, current(a=[old, model("removed")]))
    assert p.assignments["a"].models == [new]


def test_a_returning_node_gets_its_replicated_model_back_only_if_it_lacks_a_holder():
    one = model("one", replicas=1, memory_mb=1_000)
    nodes = {n: hb(n, vram_mb=10_000) for n in ["a", "b"]}
    p = plan([one], nodes, current(a=[], b=[one]))  # a came back after "one" moved to b
    assert holders(p, "one") == ["b"]


def test_a_new_model_does_not_push_an_existing_one_off_its_node():
    nodes = {"a": hb("a", vram_mb=8_000), "b": hb("b", vram_mb=12_000)}  # 7,200 and 10,800 MB
    y = model("y", replicas=1, memory_mb=6_000)
    x = model("x", replicas=1, memory_mb=6_000)  # new, and listed first
    p = plan([x, y], nodes, current(b=[y]))
    assert holders(p, "y") == ["b"]  # y fits where it is; x fits on a
    assert holders(p, "x") == ["a"]


def test_escalation_follows_the_models_burst_policy():
    from coderai.contracts import PodPolicy
    from coderai.scheduler.service import escalation_refused

    def m(burst: str) -> ModelConfig:
        return ModelConfig(name="big", engine="llama", path="x", pod=PodPolicy(burst=burst))

    assert escalation_refused(m("never"), "no_engine", True) and escalation_refused(m("never"), "busy", False)
    assert not escalation_refused(m("when_busy"), "busy", False)
    assert escalation_refused(m("when_busy"), "no_engine", True)
    assert not escalation_refused(m("when_no_fit"), "no_engine", True)
    assert "fits on a node" in escalation_refused(m("when_no_fit"), "no_engine", False)
    assert escalation_refused(m("when_no_fit"), "busy", False)
    assert not escalation_refused(m("always"), "busy", False) and not escalation_refused(
        m("always"), "no_engine", False
    )


# --- folder models and video relayed by stages ------------------------------------------------------


def video_folder(root, unet_mb: int, text_mb: int = 1000, vae_mb: int = 500):
    """A model folder whose parts have these sizes (sparse files: nothing is written)."""
    for part, mb in (("text_encoder", text_mb), ("unet", unet_mb), ("vae", vae_mb)):
        (root / part).mkdir(parents=True)
        with open(root / part / "model.safetensors", "wb") as f:
            f.truncate(mb * MB)
    return root


def test_a_folder_model_counts_every_file_in_it(tmp_path):
    folder = video_folder(tmp_path / "v", unet_mb=2000)
    assert estimate_bytes(model("v", path=str(folder))) == int(3500 * MB * 1.2) + OVERHEAD


def test_a_video_model_that_fits_no_node_whole_is_relayed_by_stages_when_its_biggest_part_fits(tmp_path):
    folder = video_folder(tmp_path / "v", unet_mb=2000)
    nodes = {n: hb(n, caps=["video"], mem_mb=4_000) for n in ["a", "b", "c"]}
    p = plan([model("v", engine="video", path=str(folder))], nodes)
    assert "v" not in p.unplaced and p.restaged["v"].params["stages"] is True
    assert holders(p, "v") == ["a", "b", "c"]
    assert all(m.params.get("stages") for a in p.assignments.values() for m in a.models)
    roomy = {**nodes, "big": hb("big", caps=["video"], mem_mb=8_000)}  # one node holds it whole: no relay
    whole = plan([model("v", engine="video", path=str(folder), replicas=1)], roomy)
    assert whole.restaged == {} and holders(whole, "v") == ["big"]


def test_a_video_model_whose_biggest_part_fits_nowhere_stays_unplaced(tmp_path):
    folder = video_folder(tmp_path / "v", unet_mb=5000)
    p = plan([model("v", engine="video", path=str(folder))], {"a": hb("a", caps=["video"], mem_mb=4_000)})
    assert holders(p, "v") == [] and p.restaged == {} and "v" in p.unplaced
