"""pick() with pins, affinity and the load guard; what a decision is recorded under; the round-robin baseline.

Least-busy picking and the engine table itself are covered in test_picking.py.
"""

from __future__ import annotations

import pytest

from coderai.contracts import BusError, EngineStatus, Heartbeat, ModelConfig, RouteRequest
from coderai.contracts.routing import AffinityEntry
from coderai.router.picking import (
    AFFINITY_TTL_S,
    EngineTable,
    LoadGuard,
    RoundRobin,
    affinity_keys,
    keys_to_record,
    pick,
)


def where(d):
    """A decision's engine, node and reason (`holders` is tested on its own)."""
    return (d.engine_id, d.node_id, d.reason)


NOW = 10_000.0


def engine(
    eid: str, model: str = "m", ops=("chat", "complete"), state: str = "ready", in_flight: int = 0
) -> EngineStatus:
    return EngineStatus(engine_id=eid, model=model, engine="llama", ops=list(ops), state=state, in_flight=in_flight)


def hb(node: str, *engines: EngineStatus, seq: int = 1) -> Heartbeat:
    return Heartbeat(
        node_id=node, version="0", seq=seq, ts=0.0, host=node, capabilities=["llama"], engines=list(engines)
    )


def table(**nodes: list[EngineStatus]) -> EngineTable:
    t = EngineTable()
    for node, engines in nodes.items():
        t.apply(hb(node, *engines), now=0.0)
    return t


def req(
    model: str = "m", op: str = "chat", session: str = "", user: str = "", prefix=(), pin: str = "", exclude=()
) -> RouteRequest:
    return RouteRequest(
        request_id="r",
        model=model,
        op=op,
        session=session,
        user=user,
        prefix=list(prefix),
        pin=pin,
        exclude=list(exclude),
    )


def at(t: EngineTable, eid: str, ts: float = NOW) -> AffinityEntry:
    return AffinityEntry(engine_id=eid, node_id=t.engines[eid].node_id, ts=ts)


def cfg(pin: str = "", allow_fallback: bool = False) -> ModelConfig:
    return ModelConfig(name="m", engine="llama", path="/models/m.gguf", pin=pin, allow_fallback=allow_fallback)


def picks(t: EngineTable) -> dict[str, int]:
    return {e: v.picks_since_hb for e, v in t.engines.items()}


# --- affinity ------------------------------------------------------------------------------------------------


def test_the_longest_known_prefix_element_wins():
    t = table(n1=[engine("A")], n2=[engine("B", in_flight=1)])
    aff = {"h1": at(t, "A"), "h3": at(t, "B")}
    d = pick(t, req(prefix=["h1", "h2", "h3", "h4"]), aff, now=NOW)
    assert where(d) == ("B", "n2", "prefix")
    assert picks(t) == {"A": 0, "B": 1}


def test_a_short_prefix_match_still_beats_least_busy():
    t = table(n1=[engine("A", in_flight=2)], n2=[engine("B")])
    d = pick(t, req(prefix=["h1", "h2", "h3"]), {"h1": at(t, "A")}, now=NOW)
    assert (d.engine_id, d.reason) == ("A", "prefix")


def test_session_beats_user_beats_prefix():
    t = table(n1=[engine("S"), engine("U"), engine("P"), engine("Z")])
    aff = {"sess": at(t, "S"), "usr": at(t, "U"), "h2": at(t, "P")}
    r = req(session="sess", user="usr", prefix=["h1", "h2"])
    assert (pick(t, r, aff, now=NOW).engine_id, pick(t, r, aff, now=NOW).reason) == ("S", "session")
    del aff["sess"]
    d = pick(t, r, aff, now=NOW)
    assert (d.engine_id, d.reason) == ("U", "user")
    del aff["usr"]
    d = pick(t, r, aff, now=NOW)
    assert (d.engine_id, d.reason) == ("P", "prefix")


def test_keys_the_request_does_not_carry_are_not_looked_up():
    # An entry under the user key does nothing for a request without that user.
    t = table(n1=[engine("A", in_flight=1), engine("B")])
    d = pick(t, req(session="s1"), {"s2": at(t, "A"), "u": at(t, "A")}, now=NOW)
    assert (d.engine_id, d.reason) == ("B", "least_busy")


def test_no_affinity_means_least_busy():
    t = table(n1=[engine("A", in_flight=1), engine("B")])
    r = req(session="s", user="u", prefix=["h1"])
    assert pick(t, r, None, now=NOW).reason == "least_busy"
    assert pick(t, r, {}, now=NOW).reason == "least_busy"
    d = pick(t, r, {"other": at(t, "A")}, now=NOW)
    assert (d.engine_id, d.reason) == ("B", "least_busy")


def test_a_request_without_keys_is_least_busy_even_with_affinity():
    t = table(n1=[engine("A", in_flight=1), engine("B")])
    d = pick(t, req(), {"": at(t, "A"), "h1": at(t, "A")}, now=NOW)
    assert (d.engine_id, d.reason) == ("B", "least_busy")


def test_a_live_affine_engine_is_kept_even_when_another_is_less_busy():
    t = table(n1=[engine("A", in_flight=3)], n2=[engine("B", in_flight=1)], n3=[engine("W", in_flight=2)])
    d = pick(t, req(session="sess"), {"sess": at(t, "W")}, now=NOW)
    assert where(d) == ("W", "n3", "session")


@pytest.mark.parametrize(
    "why",
    ["dead", "unknown", "excluded", "other-model", "other-op", "not-ready"],
)
def test_an_entry_whose_engine_cannot_take_the_request_is_skipped_as_a_fallback(why):
    t = table(n1=[engine("A", in_flight=3)], n2=[engine("B", in_flight=1)], n3=[engine("W", in_flight=2)])
    aff = {"sess": AffinityEntry(engine_id="W", node_id="n3", ts=NOW)}
    exclude = ()
    if why == "dead":
        t.drop_node("n3")
    elif why == "unknown":
        aff = {"sess": AffinityEntry(engine_id="gone", node_id="n9", ts=NOW)}
    elif why == "excluded":
        exclude = ("W",)
    elif why == "other-model":
        t.apply(hb("n3", engine("W", model="other"), seq=2), now=0.0)
    elif why == "other-op":
        t.apply(hb("n3", engine("W", ops=["complete"]), seq=2), now=0.0)
    elif why == "not-ready":
        t.apply(hb("n3", engine("W", state="unloading"), seq=2), now=0.0)
    d = pick(t, req(session="sess", exclude=exclude), aff, now=NOW)
    assert where(d) == ("B", "n2", "fallback")
    assert t.engines["B"].picks_since_hb == 1
    assert "W" not in t.engines or t.engines["W"].picks_since_hb == 0


def test_a_skipped_stronger_key_falls_through_to_a_weaker_live_one():
    t = table(n1=[engine("A"), engine("B", in_flight=1)])
    aff = {"sess": AffinityEntry(engine_id="gone", node_id="n9", ts=NOW), "h1": at(t, "B")}
    d = pick(t, req(session="sess", prefix=["h1", "h2"]), aff, now=NOW)
    assert (d.engine_id, d.reason) == ("B", "prefix")


def test_a_shorter_prefix_element_is_used_when_the_longest_points_at_a_dead_engine():
    t = table(n1=[engine("A")], n2=[engine("B", in_flight=1)], n3=[engine("C", in_flight=2)])
    aff = {"h3": at(t, "A"), "h2": at(t, "C")}
    t.drop_node("n1")
    d = pick(t, req(prefix=["h1", "h2", "h3"]), aff, now=NOW)
    assert (d.engine_id, d.reason) == ("C", "prefix")


def test_expired_entries_are_ignored():
    t = table(n1=[engine("A", in_flight=1), engine("B")])
    old = NOW - AFFINITY_TTL_S - 0.001
    aff = {"sess": at(t, "A", ts=old), "usr": at(t, "A", ts=old), "h1": at(t, "A", ts=old)}
    d = pick(t, req(session="sess", user="usr", prefix=["h1"]), aff, now=NOW)
    assert (d.engine_id, d.reason) == ("B", "least_busy")


def test_an_entry_exactly_at_the_ttl_is_still_used():
    t = table(n1=[engine("A", in_flight=1), engine("B")])
    d = pick(t, req(session="sess"), {"sess": at(t, "A", ts=NOW - AFFINITY_TTL_S)}, now=NOW)
    assert (d.engine_id, d.reason) == ("A", "session")


def test_a_custom_ttl_is_honoured():
    t = table(n1=[engine("A", in_flight=1), engine("B")])
    aff = {"sess": at(t, "A", ts=NOW - 10.0)}
    assert pick(t, req(session="sess"), aff, now=NOW, ttl_s=10.0).engine_id == "A"
    d = pick(t, req(session="sess"), aff, now=NOW, ttl_s=9.9)
    assert (d.engine_id, d.reason) == ("B", "least_busy")


def test_an_expired_stronger_key_gives_way_to_a_live_weaker_one():
    t = table(n1=[engine("A"), engine("B", in_flight=1), engine("C", in_flight=1)])
    aff = {"sess": at(t, "C", ts=NOW - AFFINITY_TTL_S - 1), "h1": at(t, "B")}
    d = pick(t, req(session="sess", prefix=["h1"]), aff, now=NOW)
    assert (d.engine_id, d.reason) == ("B", "prefix")


def test_an_entry_points_at_the_engine_wherever_its_node_is_now():
    # The entry's node id is informational; the engine id is what is looked up.
    t = table(n1=[engine("A", in_flight=1)], n2=[engine("B")])
    aff = {"sess": AffinityEntry(engine_id="A", node_id="stale-node", ts=NOW)}
    assert where(pick(t, req(session="sess"), aff, now=NOW)) == ("A", "n1", "session")


# --- load guard ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("warm", "least", "moves"),
    [
        (3, 0, False),
        (4, 0, False),
        (5, 0, True),
        (8, 4, False),
        (9, 4, True),
        (10, 4, True),
    ],
)
def test_the_load_guard_examples_via_in_flight(warm, least, moves):
    t = table(n1=[engine("W", in_flight=warm)], n2=[engine("L", in_flight=least)])
    d = pick(t, req(session="s"), {"s": at(t, "W")}, now=NOW)
    assert (d.engine_id, d.reason) == (("L", "fallback") if moves else ("W", "session"))


@pytest.mark.parametrize(
    ("warm", "least", "moves"), [(3, 0, False), (4, 0, False), (5, 0, True), (8, 4, False), (9, 4, True), (10, 4, True)]
)
def test_the_load_guard_counts_picks_since_the_last_heartbeat(warm, least, moves):
    t = table(n1=[engine("W")], n2=[engine("L")])
    t.engines["W"].picks_since_hb = warm
    t.engines["L"].picks_since_hb = least
    d = pick(t, req(session="s"), {"s": at(t, "W")}, now=NOW)
    assert (d.engine_id, d.reason) == (("L", "fallback") if moves else ("W", "session"))


def test_the_load_guard_mixes_in_flight_and_picks():
    t = table(n1=[engine("W", in_flight=2)], n2=[engine("L")])
    t.engines["W"].picks_since_hb = 2
    aff = {"s": at(t, "W")}
    assert pick(t, req(session="s"), aff, now=NOW).engine_id == "W"  # 4 vs 0 stays, and is now 5
    d = pick(t, req(session="s"), aff, now=NOW)  # 5 vs 0 moves
    assert (d.engine_id, d.reason) == ("L", "fallback")


def test_a_conversation_stays_warm_until_its_engine_pulls_clearly_ahead():
    t = table(n1=[engine("W")], n2=[engine("L")])
    aff = {"s": at(t, "W")}
    chosen = [pick(t, req(session="s"), aff, now=NOW).engine_id for _ in range(7)]
    # W takes picks until it is at 5 vs 0; then L gets one, after which 5 vs 1 stays warm again.
    assert chosen == ["W", "W", "W", "W", "W", "L", "W"]
    assert picks(t) == {"W": 6, "L": 1}


def test_a_custom_guard_is_honoured():
    t = table(n1=[engine("W", in_flight=2)], n2=[engine("L")])
    aff = {"s": at(t, "W")}
    assert pick(t, req(session="s"), aff, now=NOW, guard=LoadGuard(ratio=2.0, slack=1)).engine_id == "L"
    assert pick(t, req(session="s"), aff, now=NOW, guard=LoadGuard(ratio=1.0, slack=10)).engine_id == "W"


def test_an_overloaded_warm_engine_for_a_long_prefix_falls_to_a_shorter_ones_engine():
    t = table(n1=[engine("W", in_flight=9)], n2=[engine("S", in_flight=2)], n3=[engine("L")])
    d = pick(t, req(prefix=["h1", "h2"]), {"h2": at(t, "W"), "h1": at(t, "S")}, now=NOW)
    assert (d.engine_id, d.reason) == ("S", "prefix")


def test_the_warm_engine_that_is_also_the_least_busy_is_never_overloaded():
    t = table(n1=[engine("W", in_flight=50)], n2=[engine("X", in_flight=50)])
    d = pick(t, req(session="s"), {"s": at(t, "X")}, now=NOW)
    assert (d.engine_id, d.reason) == ("X", "session")


def test_the_fallback_after_an_overloaded_engine_goes_to_the_lowest_id_among_the_least_busy():
    t = table(n2=[engine("e-c", in_flight=1), engine("e-b", in_flight=1)], n1=[engine("W", in_flight=9)])
    t.apply(hb("n3", engine("e-d", in_flight=1)), now=0.0)
    d = pick(t, req(session="s"), {"s": at(t, "W")}, now=NOW)
    assert where(d) == ("e-b", "n2", "fallback")


# --- pins ----------------------------------------------------------------------------------------------------


def test_a_request_pin_by_engine_id():
    t = table(n1=[engine("A")], n2=[engine("B", in_flight=7)])
    assert where(pick(t, req(pin="B"), now=NOW)) == ("B", "n2", "pin")
    assert picks(t) == {"A": 0, "B": 1}


def test_a_request_pin_by_node_id_takes_the_least_busy_engine_of_that_node():
    t = table(n1=[engine("A")], n2=[engine("B", in_flight=3), engine("C", in_flight=2), engine("D", in_flight=2)])
    assert where(pick(t, req(pin="n2"), now=NOW)) == ("C", "n2", "pin")
    assert pick(t, req(pin="n2"), now=NOW).engine_id == "D"  # C is now at 3


def test_a_node_pin_breaks_ties_by_lowest_engine_id():
    t = table(n1=[engine("A")], n2=[engine("C", in_flight=2), engine("B", in_flight=2)])
    assert where(pick(t, req(pin="n2"), now=NOW)) == ("B", "n2", "pin")


def test_a_miss_on_every_key_breaks_ties_by_lowest_engine_id():
    t = table(n2=[engine("e-c", in_flight=1)], n1=[engine("e-b", in_flight=1), engine("e-z")])
    t.engines["e-z"].picks_since_hb = 1
    d = pick(t, req(session="s", prefix=["h1"]), {"other": at(t, "e-z")}, now=NOW)
    assert where(d) == ("e-b", "n1", "least_busy")


def test_a_node_pin_only_considers_that_nodes_holders_of_the_model():
    t = table(n1=[engine("A")], n2=[engine("B", model="other"), engine("C", in_flight=5)])
    assert pick(t, req(pin="n2"), now=NOW).engine_id == "C"


def test_a_pin_beats_affinity():
    t = table(n1=[engine("A")], n2=[engine("B", in_flight=4)])
    aff = {"s": at(t, "A"), "u": at(t, "A"), "h1": at(t, "A")}
    d = pick(t, req(session="s", user="u", prefix=["h1"], pin="B"), aff, now=NOW)
    assert (d.engine_id, d.reason) == ("B", "pin")
    d = pick(t, req(session="s"), aff, cfg(pin="n2"), now=NOW)
    assert (d.engine_id, d.reason) == ("B", "pin")


def test_a_pin_ignores_the_load_guard():
    t = table(n1=[engine("A")], n2=[engine("B", in_flight=100)])
    assert pick(t, req(pin="B"), now=NOW).engine_id == "B"


@pytest.mark.parametrize("why", ["unknown", "dead", "excluded", "other-model", "other-op"])
def test_a_request_pin_to_an_engine_that_is_down_raises_no_engine(why):
    t = table(n1=[engine("A")], n2=[engine("B")])
    pin, exclude = "B", ()
    if why == "unknown":
        pin = "nope"
    elif why == "dead":
        t.drop_node("n2")
    elif why == "excluded":
        exclude = ("B",)
    elif why == "other-model":
        t.apply(hb("n2", engine("B", model="other"), seq=2), now=0.0)
    elif why == "other-op":
        t.apply(hb("n2", engine("B", ops=["embed"]), seq=2), now=0.0)
    with pytest.raises(BusError) as err:
        pick(t, req(pin=pin, exclude=exclude), now=NOW)
    assert err.value.code == "no_engine"
    assert err.value.retryable is True
    assert repr(pin) in err.value.message
    assert picks(t).get("A") == 0


def test_a_request_pin_to_a_node_with_every_engine_excluded_raises():
    t = table(n1=[engine("A")], n2=[engine("B"), engine("C")])
    with pytest.raises(BusError) as err:
        pick(t, req(pin="n2", exclude=["B", "C"]), now=NOW)
    assert err.value.code == "no_engine"


def test_a_request_pin_never_falls_back_even_if_the_model_allows_it():
    t = table(n1=[engine("A")])
    with pytest.raises(BusError) as err:
        pick(t, req(pin="gone"), None, cfg(pin="A", allow_fallback=True), now=NOW)
    assert err.value.code == "no_engine"


def test_a_request_pin_raises_even_when_nothing_serves_the_model():
    with pytest.raises(BusError):
        pick(EngineTable(), req(pin="B"), now=NOW)


def test_the_request_pin_beats_the_model_pin():
    t = table(n1=[engine("A")], n2=[engine("B")])
    d = pick(t, req(pin="A"), None, cfg(pin="B"), now=NOW)
    assert (d.engine_id, d.reason) == ("A", "pin")


def test_a_model_pin_by_engine_and_by_node():
    t = table(n1=[engine("A")], n2=[engine("B", in_flight=5)])
    assert where(pick(t, req(), None, cfg(pin="B"), now=NOW)) == ("B", "n2", "pin")
    assert where(pick(t, req(), None, cfg(pin="n2"), now=NOW)) == ("B", "n2", "pin")


def test_a_model_pin_that_is_down_without_fallback_raises():
    t = table(n1=[engine("A")])
    with pytest.raises(BusError) as err:
        pick(t, req(), None, cfg(pin="B"), now=NOW)
    assert err.value.code == "no_engine"
    assert t.engines["A"].picks_since_hb == 0


def test_a_model_pin_that_is_down_with_fallback_picks_the_least_busy():
    t = table(n1=[engine("A", in_flight=2)], n2=[engine("C", in_flight=1)])
    d = pick(t, req(), None, cfg(pin="B", allow_fallback=True), now=NOW)
    assert where(d) == ("C", "n2", "fallback")
    assert picks(t) == {"A": 0, "C": 1}


def test_a_model_pin_excluded_by_the_request_falls_back_when_allowed():
    t = table(n1=[engine("A")], n2=[engine("B")])
    d = pick(t, req(exclude=["A"]), None, cfg(pin="A", allow_fallback=True), now=NOW)
    assert (d.engine_id, d.reason) == ("B", "fallback")
    with pytest.raises(BusError):
        pick(t, req(exclude=["A"]), None, cfg(pin="A"), now=NOW)


def test_a_model_pin_with_fallback_and_no_holders_returns_none():
    assert pick(EngineTable(), req(), None, cfg(pin="B", allow_fallback=True), now=NOW) is None


def test_a_model_pin_fallback_still_follows_affinity():
    # With the pinned engine down, a live affine engine is preferred over the least busy one.
    t = table(n1=[engine("A")], n2=[engine("C", in_flight=1)])
    d = pick(t, req(session="s"), {"s": at(t, "C")}, cfg(pin="B", allow_fallback=True), now=NOW)
    assert (d.engine_id, d.reason) == ("C", "session")


def test_a_model_config_without_a_pin_changes_nothing():
    t = table(n1=[engine("A", in_flight=1)], n2=[engine("B")])
    assert where(pick(t, req(), None, cfg(), now=NOW)) == ("B", "n2", "least_busy")


# --- what is recorded, and in what order keys are tried ------------------------------------------------------


def test_affinity_keys_are_strongest_first_with_prefix_longest_first():
    r = req(session="s", user="u", prefix=["h1", "h2", "h3"])
    assert affinity_keys(r) == [("session", "s"), ("user", "u"), ("prefix", "h3"), ("prefix", "h2"), ("prefix", "h1")]


def test_affinity_keys_drop_empty_keys():
    assert affinity_keys(req()) == []
    assert affinity_keys(req(user="u")) == [("user", "u")]
    assert affinity_keys(req(session="s", prefix=["h1", "", "h3"])) == [
        ("session", "s"),
        ("prefix", "h3"),
        ("prefix", "h1"),
    ]


def test_keys_to_record_are_session_user_and_the_first_and_last_prefix_elements():
    assert keys_to_record(req(session="s", user="u", prefix=["h1", "h2", "h3"])) == ["s", "u", "h1", "h3"]
    assert keys_to_record(req(prefix=["h1", "h2"])) == ["h1", "h2"]


def test_keys_to_record_deduplicate_and_drop_empties():
    assert keys_to_record(req()) == []
    assert keys_to_record(req(prefix=["h1"])) == ["h1"]
    assert keys_to_record(req(user="u", prefix=["h1"])) == ["u", "h1"]
    assert keys_to_record(req(session="k", user="k", prefix=["k", "x", "k"])) == ["k"]
    assert keys_to_record(req(session="s", prefix=["", "h2"])) == ["s", "h2"]


def test_a_recorded_decision_is_found_by_the_next_turn():
    # Turn 1 goes somewhere and is recorded; turn 2 extends its chain and lands on the same engine.
    t = table(n1=[engine("A")], n2=[engine("B")])
    first = req(prefix=["h1", "h2"])
    d1 = pick(t, first, {}, now=NOW)
    aff = {k: AffinityEntry(engine_id=d1.engine_id, node_id=d1.node_id, ts=NOW) for k in keys_to_record(first)}
    d2 = pick(t, req(prefix=["h1", "h2", "h3", "h4"]), aff, now=NOW + 1)
    assert (d2.engine_id, d2.reason) == (d1.engine_id, "prefix")


# --- round robin ---------------------------------------------------------------------------------------------


def test_round_robin_cycles_over_holders_sorted_by_id():
    t = table(n2=[engine("c", in_flight=9)], n1=[engine("b"), engine("a", in_flight=5)])
    t.apply(hb("n3", engine("x", model="other")), now=0.0)
    rr = RoundRobin()
    chosen = [rr.pick(t, req()) for _ in range(7)]
    assert [d.engine_id for d in chosen] == ["a", "b", "c", "a", "b", "c", "a"]
    assert {d.reason for d in chosen} == {"least_busy"}
    assert chosen[2].node_id == "n2"
    assert picks(t) == {"a": 3, "b": 2, "c": 2, "x": 0}


def test_round_robin_skips_excluded_engines():
    t = table(n1=[engine("a"), engine("b"), engine("c")])
    rr = RoundRobin()
    assert [rr.pick(t, req(exclude=["b"])).engine_id for _ in range(4)] == ["a", "c", "a", "c"]
    assert t.engines["b"].picks_since_hb == 0


def test_round_robin_returns_none_without_holders():
    rr = RoundRobin()
    assert rr.pick(EngineTable(), req()) is None
    t = table(n1=[engine("a", model="other"), engine("b", ops=["embed"])])
    assert rr.pick(t, req()) is None
    assert rr.pick(t, req(model="other", exclude=["a"])) is None
    assert picks(t) == {"a": 0, "b": 0}


def test_round_robin_ignores_affinity_and_pins():
    t = table(n1=[engine("a"), engine("b")])
    rr = RoundRobin()
    assert [rr.pick(t, req(session="s", pin="b")).engine_id for _ in range(2)] == ["a", "b"]


def test_round_robin_instances_keep_their_own_position():
    t = table(n1=[engine("a"), engine("b")])
    one, two = RoundRobin(), RoundRobin()
    assert one.pick(t, req()).engine_id == "a"
    assert two.pick(t, req()).engine_id == "a"
    assert one.pick(t, req()).engine_id == "b"


# --- every decision is charged to its engine -----------------------------------------------------------------


def test_every_kind_of_decision_charges_the_chosen_engine():
    t = table(n1=[engine("A")], n2=[engine("B")], n3=[engine("C")])
    aff = {"s": at(t, "A"), "u": at(t, "B"), "h1": at(t, "C")}
    reasons = [
        pick(t, req(pin="A"), now=NOW).reason,
        pick(t, req(session="s"), aff, now=NOW).reason,
        pick(t, req(user="u"), aff, now=NOW).reason,
        pick(t, req(prefix=["h1"]), aff, now=NOW).reason,
        pick(t, req(), now=NOW).reason,
        pick(t, req(), None, cfg(pin="gone", allow_fallback=True), now=NOW).reason,
    ]
    assert reasons == ["pin", "session", "user", "prefix", "least_busy", "fallback"]
    assert sum(picks(t).values()) == 6
    assert picks(t) == {"A": 2, "B": 2, "C": 2}


def test_busy_is_set_only_for_a_bursting_model_whose_least_busy_engine_is_at_its_threshold():
    from coderai.contracts import PodPolicy

    t = EngineTable()
    t.apply(hb("n1", engine("A", in_flight=3), engine("B", in_flight=4)), now=NOW)
    bursty = ModelConfig(name="m", engine="llama", path="x", pod=PodPolicy(burst="when_busy", busy_in_flight=3))
    assert pick(t, req(), None, bursty, now=NOW).busy
    assert not pick(t, req(), None, ModelConfig(name="m", engine="llama", path="x"), now=NOW).busy
    relaxed = ModelConfig(name="m", engine="llama", path="x", pod=PodPolicy(burst="always", busy_in_flight=10))
    assert not pick(t, req(), None, relaxed, now=NOW).busy


def test_a_bursting_models_saturated_warm_engine_yields_to_an_idle_one():
    from coderai.contracts import PodPolicy

    t = EngineTable()
    t.apply(hb("n1", engine("A", in_flight=2)), now=NOW)
    t.apply(hb("pod", engine("P", in_flight=0)), now=NOW)
    r = req(prefix=["p1"])
    aff = {"p1": AffinityEntry(engine_id="A", node_id="n1", ts=NOW)}
    bursty = ModelConfig(name="m", engine="llama", path="x", pod=PodPolicy(burst="when_busy", busy_in_flight=2))
    d = pick(t, r, aff, bursty, now=NOW)
    assert (d.engine_id, d.reason, d.busy) == ("P", "fallback", False)
    calm = ModelConfig(name="m", engine="llama", path="x")
    assert pick(t, r, aff, calm, now=NOW).engine_id == "A"  # without burst, affinity holds as before
