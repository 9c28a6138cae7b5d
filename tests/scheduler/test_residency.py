"""Residency over the pure placement: on-demand loads, keep-alive unloads, LRU eviction (scheduler/residency.py)."""

from __future__ import annotations

from coderai.contracts import Assignment, EngineStatus, Heartbeat, ModelConfig
from coderai.contracts.models import ON_DEMAND_KEEP_ALIVE_S
from coderai.scheduler.residency import Residency, keep_alive
from coderai.testing.heartbeats import heartbeat

GB = 1 << 30


def model(name: str, mb: int = 1000, **kw) -> ModelConfig:
    return ModelConfig(name=name, engine="llama", path=f"/m/{name}.gguf", memory_mb=mb, **kw)


def node(node_id: str = "n1", ram_gb: float = 2.5, engines: list[EngineStatus] = ()) -> Heartbeat:
    """A CPU node whose 90 % of RAM holds two 1000 MB models, not three."""
    return heartbeat(
        node_id,
        version="t",
        engines=list(engines),
        mem_total=int(ram_gb * GB),
        mem_free=int(ram_gb * GB),
    )


def engine(
    name: str,
    node_id: str = "n1",
    idle_s: float = 0.0,
    in_flight: int = 0,
    state: str = "ready",
    keep_alive_s: float | None = None,
) -> EngineStatus:
    return EngineStatus(
        engine_id=f"{node_id}-{name}",
        model=name,
        engine="llama",
        ops=["chat"],
        state=state,
        in_flight=in_flight,
        idle_s=idle_s,
        keep_alive_s=keep_alive_s,
    )


def names(plan, node_id: str = "n1") -> list[str]:
    return sorted(m.name for m in plan.assignments[node_id].models)


def holding(*models: ModelConfig, node_id: str = "n1") -> dict[str, Assignment]:
    return {node_id: Assignment(node_id=node_id, models=list(models))}


def test_an_on_demand_model_is_placed_only_once_asked_for():
    r = Residency()
    od = model("od", resident="on_demand")
    nodes = {"n1": node()}
    assert names(r.plan([od], nodes, {}, now=0)) == []
    r.ask("od", now=1)
    assert names(r.plan([od], nodes, {}, now=2)) == ["od"]
    assert r.demand == {}  # placed: the demand is met
    # held, it stays placed on later passes without being asked again
    assert names(r.plan([od], nodes, holding(od), now=500)) == ["od"]


def test_a_model_asked_for_evicts_the_least_recently_used_idle_one():
    r = Residency()
    a, b, c = model("a"), model("b"), model("c")
    nodes = {"n1": node(engines=[engine("a", idle_s=5), engine("b", idle_s=50)])}
    first = r.plan([a, b, c], nodes, {}, now=0)
    assert names(first) == ["a", "b"] and "c" in first.unplaced  # auto: placed while they fit
    r.ask("c", now=1)
    got = r.plan([a, b, c], nodes, holding(a, b), now=2)
    assert names(got) == ["a", "c"]  # b was idle longest
    assert r.gone == {("b", "n1"): "evicted"}
    # b is parked: it is not placed back by itself, even when room comes back
    nodes = {"n1": node(engines=[engine("a", idle_s=5), engine("c", idle_s=1)])}
    assert names(r.plan([a, b, c], nodes, holding(a, c), now=3)) == ["a", "c"]
    r.ask("b", now=4)  # asked for again: back, in place of the now least recently used a
    assert names(r.plan([a, b, c], nodes, holding(a, c), now=5)) == ["b", "c"]


def test_never_evicted_busy_always_loading_or_just_used_copies_a_request_waits_for_them():
    a, b, c = model("a", resident="always"), model("b"), model("c")
    for status in (
        [engine("a", idle_s=99), engine("b", idle_s=50, in_flight=1)],
        [engine("a", idle_s=99), engine("b", state="loading")],
        [engine("a", idle_s=99), engine("b", idle_s=0.5)],  # may have taken a request since
        [engine("a", idle_s=99)],
    ):  # b not reported yet: it is still loading
        r = Residency()
        r.ask("c", now=1)
        got = r.plan([a, b, c], {"n1": node(engines=status)}, holding(a, b), now=2)
        assert names(got) == ["a", "b"], status
        assert r.waiting == {"c"} and r.no_room == {} and r.gone == {}
        # once b is idle, the next pass (on a heartbeat) evicts it for c
        got = r.plan(
            [a, b, c], {"n1": node(engines=[engine("a", idle_s=99), engine("b", idle_s=4)])}, holding(a, b), now=3
        )
        assert names(got) == ["a", "c"] and r.waiting == set() and r.gone == {("b", "n1"): "evicted"}


def test_no_room_when_only_always_copies_or_nothing_could_make_it():
    a, big = model("a", resident="always"), model("big", 2000)
    r = Residency()
    r.ask("big", now=1)
    r.plan([a, big], {"n1": node(engines=[engine("a", idle_s=99)])}, holding(a), now=2)
    assert r.waiting == set() and "big" in r.no_room


def test_min_replicas_copies_are_neither_evicted_nor_unloaded_when_idle():
    r = Residency()
    a, b, c = model("a", min_replicas=1, keep_alive_s=1), model("b", keep_alive_s=1), model("c")
    nodes = {"n1": node(engines=[engine("a", idle_s=99), engine("b", idle_s=2)])}
    got = r.plan([a, b, c], nodes, holding(a, b), now=0)
    assert names(got) == ["a", "c"]  # b idle past its keep-alive, so c took its room; a is kept
    assert r.gone == {("b", "n1"): "idle"}


def test_keep_alive_unloads_an_idle_copy_and_the_next_request_loads_it_again():
    r = Residency()
    od = model("od", resident="on_demand", keep_alive_s=10)
    held = holding(od)
    assert names(r.plan([od], {"n1": node(engines=[engine("od", idle_s=9)])}, held, now=0)) == ["od"]
    assert names(r.plan([od], {"n1": node(engines=[engine("od", idle_s=11)])}, held, now=1)) == []
    assert r.gone == {("od", "n1"): "idle"}
    r.ask("od", now=2)
    assert names(r.plan([od], {"n1": node()}, {"n1": Assignment(node_id="n1")}, now=3)) == ["od"]


def test_keep_alive_comes_from_the_last_request_then_the_config_then_the_residency():
    assert keep_alive(model("x", resident="on_demand"), None) == ON_DEMAND_KEEP_ALIVE_S
    assert keep_alive(model("x"), None) is None  # auto: held until evicted
    assert keep_alive(model("x", keep_alive_s=30), None) == 30
    assert keep_alive(model("x", keep_alive_s=30), engine("x", keep_alive_s=0)) == 0  # Ollama's keep_alive=0
    assert keep_alive(model("x", resident="on_demand"), engine("x", keep_alive_s=-1)) is None  # forever
    assert keep_alive(model("x", resident="always", keep_alive_s=5), None) is None


def test_eviction_picks_the_node_that_needs_fewest_unloads():
    r = Residency()
    ms = [model(n, replicas=1) for n in ("a", "b", "c", "d")] + [model("big", 2000, replicas=1)]
    n1 = node("n1", engines=[engine("a", "n1", idle_s=90), engine("b", "n1", idle_s=80)])
    n2 = node("n2", ram_gb=3.4, engines=[engine("c", "n2", idle_s=10), engine("d", "n2", idle_s=5)])
    current = {"n1": Assignment(node_id="n1", models=ms[:2]), "n2": Assignment(node_id="n2", models=ms[2:4])}
    r.ask("big", now=1)
    got = r.plan(ms, {"n1": n1, "n2": n2}, current, now=2)
    # n2 (3.06 GB usable) makes room for 2000 MB by unloading one copy; n1 would need both
    assert names(got, "n2") == ["big", "d"] and names(got, "n1") == ["a", "b"]
    assert r.gone == {("c", "n2"): "evicted"}  # idle 10 s, d 5 s
