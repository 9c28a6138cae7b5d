"""Placement is pure: each live node gets the models its engine families can run, or that name it."""

from __future__ import annotations

from coderai.contracts import Assignment, Heartbeat, ModelConfig
from coderai.scheduler.placement import plan


def hb(node: str, caps: list[str]) -> Heartbeat:
    return Heartbeat(node_id=node, version="0", seq=1, ts=0.0, host=node, capabilities=caps)


def model(name: str, engine: str = "llama", nodes: list[str] | None = None) -> ModelConfig:
    return ModelConfig(name=name, engine=engine, path=f"/m/{name}", nodes=nodes or [])


def names(a: Assignment) -> list[str]:
    return [m.name for m in a.models]


def test_no_nodes_means_an_empty_plan():
    assert plan([model("a")], {}) == {}


def test_no_models_gives_every_node_an_empty_assignment():
    out = plan([], {"n1": hb("n1", ["llama"]), "n2": hb("n2", [])})
    assert out == {"n1": Assignment(node_id="n1", models=[]), "n2": Assignment(node_id="n2", models=[])}


def test_models_go_to_every_node_with_the_engine_family():
    models = [model("chat", "llama"), model("emb", "embed"), model("img", "diffusers")]
    nodes = {"gpu": hb("gpu", ["llama", "diffusers"]), "cpu": hb("cpu", ["embed", "llama"]), "bare": hb("bare", [])}
    out = plan(models, nodes)
    assert set(out) == {"gpu", "cpu", "bare"}
    assert all(out[n].node_id == n for n in out)
    assert names(out["gpu"]) == ["chat", "img"]
    assert names(out["cpu"]) == ["chat", "emb"]
    assert names(out["bare"]) == []


def test_assigned_models_are_the_configs_themselves_in_file_order():
    models = [model("z"), model("a")]
    out = plan(models, {"n": hb("n", ["llama"])})
    assert out["n"].models == models


def test_nodes_restricts_a_model_to_the_named_nodes():
    models = [model("pinned", nodes=["n2"]), model("everywhere")]
    nodes = {"n1": hb("n1", ["llama"]), "n2": hb("n2", ["llama"]), "n3": hb("n3", ["llama"])}
    out = plan(models, nodes)
    assert names(out["n1"]) == ["everywhere"]
    assert names(out["n2"]) == ["pinned", "everywhere"]
    assert names(out["n3"]) == ["everywhere"]


def test_a_named_node_without_the_capability_does_not_get_the_model():
    out = plan([model("pinned", "whisper", nodes=["n1"])], {"n1": hb("n1", ["llama"]), "n2": hb("n2", ["whisper"])})
    assert names(out["n1"]) == []
    assert names(out["n2"]) == []


def test_a_model_naming_only_absent_nodes_goes_nowhere():
    out = plan([model("pinned", nodes=["gone"])], {"n1": hb("n1", ["llama"])})
    assert out == {"n1": Assignment(node_id="n1", models=[])}


def test_plan_is_keyed_in_sorted_node_order():
    nodes = {n: hb(n, ["llama"]) for n in ["c", "a", "b"]}
    assert list(plan([model("m")], nodes)) == ["a", "b", "c"]
