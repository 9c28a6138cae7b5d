"""The scheduler's state changes in one place: `apply(state, event)` returns the next state and never touches the
one it was given."""

from __future__ import annotations

import copy

import pytest

from coderai.contracts import Assignment, Heartbeat, ModelConfig
from coderai.contracts.split import RpcServer, SplitDevice, SplitPlan
from coderai.scheduler.placement import Plan
from coderai.scheduler.state import (
    LayersRead,
    ModelRemoved,
    ModelSet,
    ModelsLoaded,
    NodeGone,
    NodeRevoked,
    NodeSeen,
    Planned,
    State,
    apply,
    heard,
    joined,
    live,
    silent,
)

TTL = 10.0


def hb(node: str, caps: tuple[str, ...] = ("llama",), pod: str = "", **kw) -> Heartbeat:
    return Heartbeat(node_id=node, version="0", seq=1, ts=0.0, host=node, capabilities=list(caps), pod=pod, **kw)


def model(name: str, **kw) -> ModelConfig:
    return ModelConfig(name=name, engine="llama", path=f"/m/{name}.gguf", **kw)


def applied(state: State, event) -> State:
    """`apply`, checking that the state it was given is left as it was."""
    before = copy.deepcopy(state)
    after = apply(state, event)
    assert state == before and after is not state
    return after


def test_models_loaded_replaces_the_whole_set():
    s = applied(State(models=[model("old")]), ModelsLoaded((model("a"), model("b"))))
    assert [m.name for m in s.models] == ["a", "b"]


def test_a_model_set_is_added_at_the_end_or_replaced_in_its_place_and_forgets_its_restage_and_layers():
    s = State(
        models=[model("a"), model("b")], restaged={"a": model("a", params={"stages": True})}, layers={"a": 32, "b": 40}
    )
    s = applied(s, ModelSet(model("a", replicas=3)))
    assert [(m.name, m.replicas) for m in s.models] == [("a", 3), ("b", 0)]
    assert s.restaged == {} and s.layers == {"b": 40}
    s = applied(s, ModelSet(model("c")))
    assert [m.name for m in s.models] == ["a", "b", "c"] and s.layers == {"b": 40}


def test_a_removed_model_is_gone_with_its_restage_and_layers():
    s = State(models=[model("a"), model("b")], restaged={"b": model("b")}, layers={"b": 40})
    s = applied(s, ModelRemoved("b"))
    assert [m.name for m in s.models] == ["a"] and s.restaged == {} and s.layers == {}
    assert applied(s, ModelRemoved("nope")).models == s.models


def test_a_node_is_seen_gone_or_revoked():
    s = applied(State(), NodeSeen(hb("a"), 5.0))
    s = applied(s, NodeSeen(hb("b"), 6.0))
    assert set(s.nodes) == {"a", "b"} and s.seen == {"a": 5.0, "b": 6.0}
    s = applied(s, NodeGone("a"))
    assert set(s.nodes) == {"b"} and s.seen == {"b": 6.0}
    s = applied(s, NodeRevoked("b", 7.0))
    assert s.nodes == {} and s.seen == {} and s.revoked_at == {"b": 7.0}
    assert applied(s, NodeGone("never")).nodes == {}


def test_layers_read_are_added_to_those_known():
    assert applied(State(layers={"a": 1}), LayersRead({"b": 2})).layers == {"a": 1, "b": 2}


def test_planned_records_the_pass_unplaced_splits_and_restaged():
    split = SplitPlan(mode="layer", devices=[SplitDevice(node_id="a", endpoint="", share=1.0)])
    p = Plan(
        {"a": Assignment(node_id="a")}, unplaced={"x": "why"}, splits={"big": ("a", split)}, restaged={"v": model("v")}
    )
    s = applied(State(unplaced={"old": "why"}), Planned(p))
    assert s.last_plan is p and s.unplaced == {"x": "why"} and s.splits == {"big": split}
    assert s.restaged == {"v": model("v")}


def test_anything_else_is_not_an_event():
    with pytest.raises(TypeError):
        apply(State(), "model added")  # a wrong event, on purpose


def test_a_revoked_node_is_not_heard_for_a_heartbeat_timeout():
    s = State(revoked_at={"a": 100.0})
    assert not heard(s, hb("a"), 105.0, TTL) and heard(s, hb("a"), 110.0, TTL)
    assert heard(s, hb("b"), 0.0, TTL)


def test_a_node_has_joined_when_new_or_its_families_rpc_or_addresses_change():
    old = hb("a", addrs=["10.0.0.1"])
    assert joined(None, old) and not joined(old, hb("a", addrs=["10.0.0.1"]))
    assert joined(old, hb("a", caps=("llama", "embed"), addrs=["10.0.0.1"]))
    assert joined(old, hb("a", addrs=["10.0.0.2"]))
    assert joined(old, hb("a", addrs=["10.0.0.1"], rpc=RpcServer(endpoint="10.0.0.1:50052")))


def test_silent_and_live_nodes_by_when_they_were_last_heard():
    s = State(nodes={"a": hb("a"), "b": hb("b"), "p": hb("p", pod="pod-1")}, seen={"a": 0.0, "b": 15.0, "p": 15.0})
    assert silent(s, 20.0, TTL) == ["a"]
    assert set(live(s, 20.0, TTL)) == {"b", "p"} and set(live(s, 20.0, TTL, pods=False)) == {"b"}
