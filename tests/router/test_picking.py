"""Routing is pure: the engine table follows heartbeats, and pick() chooses the least loaded live holder."""

from __future__ import annotations

from coderai.contracts import EngineStatus, Heartbeat, RouteRequest
from coderai.router.picking import MAX_SLOTS, EngineTable, EngineView, fault_ref, pick


def where(d):
    """A decision's engine, node and reason (`holders` is tested on its own)."""
    return (d.engine_id, d.node_id, d.reason)


def engine(
    eid: str,
    model: str = "m",
    ops=("chat", "complete"),
    state: str = "ready",
    in_flight: int = 0,
    error: str | None = None,
) -> EngineStatus:
    return EngineStatus(
        engine_id=eid, model=model, engine="llama", ops=list(ops), state=state, in_flight=in_flight, error=error
    )


def hb(node: str, *engines: EngineStatus, seq: int = 1) -> Heartbeat:
    return Heartbeat(
        node_id=node, version="0", seq=seq, ts=0.0, host=node, capabilities=["llama"], engines=list(engines)
    )


def req(model: str = "m", op: str = "chat", exclude=()) -> RouteRequest:
    return RouteRequest(request_id="r", model=model, op=op, exclude=list(exclude))


def test_engine_view_load_counts_picks_not_yet_seen_by_a_heartbeat():
    v = EngineView("e", "n", "m", frozenset({"chat"}), in_flight=3, picks_since_hb=2)
    assert v.load == 5


def test_apply_keeps_only_ready_engines():
    t = EngineTable()
    t.apply(
        hb(
            "n1",
            engine("e1"),
            engine("e2", state="loading"),
            engine("e3", state="failed"),
            engine("e4", state="unloading"),
        ),
        now=0.0,
    )
    assert set(t.engines) == {"e1"}
    v = t.engines["e1"]
    assert (v.node_id, v.model, v.ops, v.in_flight, v.picks_since_hb) == (
        "n1",
        "m",
        frozenset({"chat", "complete"}),
        0,
        0,
    )
    assert t.node_seen == {"n1": 0.0}


def test_apply_replaces_the_nodes_engines_and_leaves_other_nodes_alone():
    t = EngineTable()
    t.apply(hb("n1", engine("e1"), engine("e2")), now=0.0)
    t.apply(hb("n2", engine("e9")), now=0.0)
    t.apply(hb("n1", engine("e3", in_flight=4), seq=2), now=1.0)
    assert set(t.engines) == {"e3", "e9"}
    assert t.engines["e3"].in_flight == 4
    assert t.node_seen == {"n1": 1.0, "n2": 0.0}


def test_apply_with_no_ready_engines_empties_the_node_but_keeps_it_alive():
    t = EngineTable()
    t.apply(hb("n1", engine("e1")), now=0.0)
    t.apply(hb("n1", engine("e1", state="unloading")), now=1.0)
    assert t.engines == {}
    assert t.node_seen == {"n1": 1.0}


def test_expire_drops_silent_nodes_and_returns_their_ids():
    t = EngineTable(ttl_s=6.0)
    t.apply(hb("old", engine("e1"), engine("e2")), now=0.0)
    t.apply(hb("fresh", engine("e3")), now=5.0)
    assert t.expire(now=6.0) == []  # exactly at the TTL is still alive
    assert set(t.engines) == {"e1", "e2", "e3"}
    assert t.expire(now=6.5) == ["old"]
    assert set(t.engines) == {"e3"}
    assert set(t.node_seen) == {"fresh"}
    assert t.expire(now=6.5) == []
    assert sorted(t.expire(now=100.0)) == ["fresh"]
    assert t.engines == {} and t.node_seen == {}


def test_expire_honours_a_custom_ttl():
    t = EngineTable(ttl_s=1.0)
    t.apply(hb("n1", engine("e1")), now=10.0)
    assert t.expire(now=11.0) == []
    assert t.expire(now=11.01) == ["n1"]


def test_holders_filter_by_model_and_op():
    t = EngineTable()
    t.apply(
        hb(
            "n1",
            engine("chat-a", model="a", ops=["chat"]),
            engine("emb-a", model="a", ops=["embed"]),
            engine("chat-b", model="b", ops=["chat", "complete"]),
        ),
        now=0.0,
    )
    assert [v.engine_id for v in t.holders("a", "chat")] == ["chat-a"]
    assert [v.engine_id for v in t.holders("a", "embed")] == ["emb-a"]
    assert [v.engine_id for v in t.holders("b", "complete")] == ["chat-b"]
    assert t.holders("b", "embed") == []
    assert t.holders("zzz", "chat") == []


def test_pick_returns_none_when_nothing_holds_the_model_or_op():
    t = EngineTable()
    assert pick(t, req()) is None
    t.apply(hb("n1", engine("e1", model="other")), now=0.0)
    assert pick(t, req(model="m")) is None
    assert pick(t, req(model="other", op="embed")) is None


def test_pick_chooses_the_least_loaded_engine():
    t = EngineTable()
    t.apply(hb("n1", engine("e1", in_flight=5)), now=0.0)
    t.apply(hb("n2", engine("e2", in_flight=1), engine("e3", in_flight=3)), now=0.0)
    d = pick(t, req())
    assert where(d) == ("e2", "n2", "least_busy")
    assert d.holders == 3  # the gateway splits a fan-out request only over two or more


def test_pick_weighs_load_by_the_engines_slots():
    t = EngineTable()
    many = EngineStatus(
        engine_id="e8",
        model="m",
        engine="llama-server",
        ops=["chat"],
        state="ready",
        in_flight=4,
        slots=8,
        slots_busy=4,
    )
    t.apply(hb("n1", engine("e1", in_flight=1)), now=0.0)  # one request on a one-at-a-time engine: full
    t.apply(hb("n2", many), now=0.0)  # four on eight slots: half full
    assert t.engines["e8"].busy_share == 0.5 and t.engines["e1"].busy_share == 1.0
    assert where(pick(t, req()))[0] == "e8"


def test_the_guard_keeps_a_conversation_on_an_engine_with_a_free_slot():
    from coderai.router.picking import LoadGuard

    guard = LoadGuard()
    warm = EngineView("w", "n1", "m", frozenset({"chat"}), in_flight=6, slots=8)
    idle = EngineView("i", "n2", "m", frozenset({"chat"}), in_flight=0)
    assert not guard.overloaded(warm, idle)  # 6 of 8 slots: the warm cache still wins
    full = EngineView("f", "n1", "m", frozenset({"chat"}), in_flight=9, slots=8)
    assert guard.overloaded(full, idle)  # every slot busy and a clear gap: move


def test_holders_counts_the_engines_that_could_take_it():
    t = EngineTable()
    t.apply(hb("n1", engine("e1")), now=0.0)
    assert pick(t, req()).holders == 1
    t.apply(hb("n2", engine("e2"), engine("e3", model="other")), now=0.0)
    assert pick(t, req()).holders == 2
    assert pick(t, RouteRequest(request_id="r", model="m", op="chat", exclude=["e1"])).holders == 1


def test_pick_breaks_ties_by_lowest_engine_id():
    t = EngineTable()
    t.apply(hb("n2", engine("e-b", in_flight=2)), now=0.0)
    t.apply(hb("n1", engine("e-c", in_flight=2), engine("e-a", in_flight=2)), now=0.0)
    d = pick(t, req())
    assert (d.engine_id, d.node_id) == ("e-a", "n1")


def test_pick_counts_against_the_chosen_engine_so_consecutive_picks_spread():
    t = EngineTable()
    t.apply(hb("n1", engine("e1"), engine("e2"), engine("e3", in_flight=1)), now=0.0)
    chosen = [pick(t, req()).engine_id for _ in range(6)]
    # e1/e2 start at 0, e3 at 1: load climbs evenly; ties go to the engine picked least recently.
    assert chosen == ["e1", "e2", "e3", "e1", "e2", "e3"]
    assert {e: v.picks_since_hb for e, v in t.engines.items()} == {"e1": 2, "e2": 2, "e3": 2}
    assert {e: v.load for e, v in t.engines.items()} == {"e1": 2, "e2": 2, "e3": 3}


def test_a_heartbeat_resets_the_pick_counters_of_its_node_only():
    t = EngineTable()
    t.apply(hb("n1", engine("e1")), now=0.0)
    t.apply(hb("n2", engine("e2")), now=0.0)
    for _ in range(4):
        pick(t, req())
    assert t.engines["e1"].picks_since_hb == 2 and t.engines["e2"].picks_since_hb == 2
    t.apply(hb("n1", engine("e1", in_flight=2), seq=2), now=1.0)
    assert t.engines["e1"].picks_since_hb == 0 and t.engines["e1"].load == 2
    assert t.engines["e2"].picks_since_hb == 2


def test_a_heartbeat_with_higher_in_flight_moves_traffic_elsewhere():
    t = EngineTable()
    t.apply(hb("n1", engine("e1")), now=0.0)
    t.apply(hb("n2", engine("e2", in_flight=1)), now=0.0)
    assert pick(t, req()).engine_id == "e1"
    t.apply(hb("n1", engine("e1", in_flight=7), seq=2), now=1.0)
    assert pick(t, req()).engine_id == "e2"


def test_pick_skips_excluded_engines():
    t = EngineTable()
    t.apply(hb("n1", engine("e1"), engine("e2", in_flight=9)), now=0.0)
    assert pick(t, req(exclude=["e1"])).engine_id == "e2"
    assert t.engines["e1"].picks_since_hb == 0  # an excluded engine is not charged
    assert pick(t, req(exclude=["e1", "e2"])) is None
    assert pick(t, req(exclude=["unknown"])).engine_id == "e1"


def test_pick_does_not_charge_anyone_when_it_returns_none():
    t = EngineTable()
    t.apply(hb("n1", engine("e1", model="a")), now=0.0)
    assert pick(t, req(model="b")) is None
    assert t.engines["e1"].picks_since_hb == 0


def test_expired_nodes_are_not_picked():
    t = EngineTable(ttl_s=6.0)
    t.apply(hb("dead", engine("e0")), now=0.0)
    t.apply(hb("live", engine("e9", in_flight=10)), now=5.0)
    assert pick(t, req()).engine_id == "e0"
    assert t.expire(now=7.0) == ["dead"]
    assert pick(t, req()).engine_id == "e9"
    assert t.expire(now=20.0) == ["live"]
    assert pick(t, req()) is None


def test_a_node_that_comes_back_after_expiry_is_picked_again():
    t = EngineTable(ttl_s=1.0)
    t.apply(hb("n1", engine("e1")), now=0.0)
    t.expire(now=5.0)
    assert pick(t, req()) is None
    t.apply(hb("n1", engine("e1"), seq=2), now=5.0)
    assert where(pick(t, req())) == ("e1", "n1", "least_busy")


def test_failed_engines_are_remembered_by_fault_reference_until_their_node_says_otherwise():
    t = EngineTable()
    why = "RPC server 10.0.0.2:50052 on node b is unreachable"
    t.apply(hb("n1", engine("e1", state="failed", error=why)), now=0.0)
    assert t.failures("m") == [fault_ref("n1", "e1", why)] and t.failures("other") == []
    assert why not in repr(t.failed)  # the node's text is the operator's (the router logs it), never a tenant's
    t.apply(hb("n1", engine("e1")), now=1.0)  # back
    assert t.failures("m") == [] and set(t.engines) == {"e1"}
    t.apply(hb("n1", engine("e1", state="failed")), now=2.0)
    assert t.failures("m") == [fault_ref("n1", "e1", "")] != [fault_ref("n1", "e1", why)]
    t.drop_node("n1")
    assert t.failures("m") == []


def test_a_node_counts_only_for_the_engines_it_was_given():
    t = EngineTable()
    refused = t.apply(
        hb(
            "n1",
            engine("n1-m"),
            engine("n1-other", model="other"),
            engine("n1-x", model="x", state="failed", error="https://phish.example"),
        ),
        now=0.0,
        placed=frozenset({"m"}),
    )
    assert set(t.engines) == {"n1-m"} and t.failures("x") == []
    assert [(e.engine_id, "not placed on it" in why) for e, why in refused] == [("n1-other", True), ("n1-x", True)]
    # the model placed there, under another engine's id (a victim's, or one made up): not believed either
    t.apply(hb("n2", engine("n2-m")), now=0.0, placed=frozenset({"m"}))
    refused = t.apply(hb("n1", engine("n2-m"), engine("n1-m-2")), now=1.0, placed=frozenset({"m"}))
    assert len(refused) == 2 and t.engines["n2-m"].node_id == "n2" and "n1-m" not in t.engines
    # nothing placed: nothing counts; placed again: the last heartbeat counts at once
    assert t.apply(hb("n3", engine("n3-m")), now=1.0, placed=frozenset()) and "n3-m" not in t.engines
    assert t.reapply("n3", frozenset({"m"})) == [] and "n3-m" in t.engines
    assert t.reapply("n3", frozenset()) and "n3-m" not in t.engines
    assert t.reapply("gone", frozenset({"m"})) == []


def test_load_a_node_reports_is_clamped():
    t = EngineTable()
    huge = EngineStatus(
        engine_id="n1-m", model="m", engine="llama", ops=["chat"], state="ready", slots=100_000, in_flight=-50
    )
    t.apply(hb("n1", huge), now=0.0, placed=frozenset({"m"}))
    v = t.engines["n1-m"]
    assert v.slots == MAX_SLOTS and v.in_flight == 0
