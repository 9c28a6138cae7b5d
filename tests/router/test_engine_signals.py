"""Routing on what the engines themselves say (issue 44, item 3): each engine's busy slots and queue count into its
load, and an engine whose KV cache is nearly full takes no new conversation while another holder has room; a warm
conversation stays on it unless the load guard trips. Tables are built from heartbeats, as the router builds them.

A node's figures are its own word: absurd ones (negative, NaN, huge) are clamped, and never make its engine look
less busy than an idle one that reports nothing."""

from __future__ import annotations

import math

import msgspec
import pytest

from coderai.contracts import EngineStatus, Heartbeat, RouteRequest
from coderai.contracts.routing import AffinityEntry
from coderai.router.picking import KV_FULL, MAX_IN_FLIGHT, EngineTable, pick

NOW = 10_000.0


def engine(eid: str, in_flight: int = 0, **reported) -> EngineStatus:
    return EngineStatus(
        engine_id=eid, model="m", engine="llama-server", ops=["chat"], state="ready", in_flight=in_flight, **reported
    )


def table(**nodes: list[EngineStatus]) -> EngineTable:
    t = EngineTable()
    for node, engines in nodes.items():
        t.apply(Heartbeat(node_id=node, version="0", seq=1, ts=0.0, host=node, capabilities=[], engines=engines), 0.0)
    return t


def req(session: str = "", prefix=()) -> RouteRequest:
    return RouteRequest(request_id="r", model="m", op="chat", session=session, prefix=list(prefix))


def at(t: EngineTable, eid: str) -> AffinityEntry:
    return AffinityEntry(engine_id=eid, node_id=t.engines[eid].node_id, ts=NOW)


def chosen(t: EngineTable, r: RouteRequest | None = None, aff=None) -> tuple[str, str]:
    d = pick(t, r or req(), aff, now=NOW)
    assert d is not None
    return d.engine_id, d.reason


# --- load: at least what the engine reports ------------------------------------------------------------------


def test_an_engines_own_running_and_queued_requests_count_when_the_workers_count_misses_them():
    t = table(n1=[engine("A", in_flight=0, slots_busy=2, queued=3)], n2=[engine("B", in_flight=1)])
    assert t.engines["A"].load == 5 and t.engines["B"].load == 1
    assert chosen(t) == ("B", "least_busy")


def test_the_workers_count_stands_when_the_engine_reports_less():
    # llama-server's slots hold what runs; the worker's in_flight also holds what waits in its own queue
    t = table(n1=[engine("A", in_flight=6, slots_busy=2, queued=0)])
    assert t.engines["A"].load == 6  # the larger of the two, never their sum: one request is not counted twice


def test_picks_since_the_heartbeat_add_to_the_reported_load():
    t = table(n1=[engine("A", slots_busy=1, queued=1)], n2=[engine("B", in_flight=3)])
    # 2 vs 3: A, now 3; 3 vs 3: B (picked least lately), now 4; 3 vs 4: A
    assert [chosen(t)[0] for _ in range(3)] == ["A", "B", "A"]
    assert t.engines["A"].load == 4 and t.engines["B"].load == 4


def test_reported_load_is_weighed_per_slot():
    t = table(
        n1=[engine("A", slots=8, slots_busy=4, queued=0)],  # half its slots
        n2=[engine("B", slots=2, slots_busy=2, queued=0)],  # every slot
    )
    assert t.engines["A"].busy_share == 0.5 and t.engines["B"].busy_share == 1.0
    assert chosen(t)[0] == "A"


# --- KV: a nearly full cache takes no new conversation ---------------------------------------------------------


def test_a_new_conversation_goes_to_a_holder_with_room_in_its_cache_even_a_busier_one():
    t = table(n1=[engine("F", kv_used=0.95)], n2=[engine("R", in_flight=3, kv_used=0.5)])
    assert t.engines["F"].kv_full and not t.engines["R"].kv_full
    assert chosen(t, req(prefix=["h1"])) == ("R", "least_busy")


def test_just_under_the_mark_is_room():
    t = table(n1=[engine("A", kv_used=KV_FULL - 0.01)], n2=[engine("B", in_flight=1)])
    assert chosen(t)[0] == "A"
    t = table(n1=[engine("A", kv_used=KV_FULL)], n2=[engine("B", in_flight=1)])
    assert chosen(t)[0] == "B"


def test_when_every_holder_is_full_the_least_busy_of_them_takes_it():
    t = table(n1=[engine("A", in_flight=2, kv_used=0.97)], n2=[engine("B", in_flight=1, kv_used=0.92)])
    assert chosen(t) == ("B", "least_busy")


def test_a_warm_conversation_stays_on_its_full_engine_unless_the_guard_trips():
    t = table(n1=[engine("W", in_flight=2, slots=8, kv_used=0.95)], n2=[engine("R")])
    aff = {"h2": at(t, "W")}
    assert chosen(t, req(prefix=["h1", "h2"]), aff) == ("W", "prefix")  # 3 vs 0: its cached prefix wins
    t = table(n1=[engine("W", in_flight=5, slots=8, kv_used=0.95)], n2=[engine("R")])
    # five on eight slots: with room in its cache it would keep the conversation (a free slot takes it at once);
    # with the cache full no slot is really free, and 5 vs 0 is a clear gap: to the holder with room
    assert chosen(t, req(prefix=["h1", "h2"]), {"h2": at(t, "W")}) == ("R", "fallback")
    t = table(n1=[engine("W", in_flight=5, slots=8, kv_used=0.5)], n2=[engine("R")])
    assert chosen(t, req(prefix=["h1", "h2"]), {"h2": at(t, "W")}) == ("W", "prefix")


def test_the_guard_weighs_a_warm_engine_against_the_least_busy_holder_with_room():
    # the full idle one would make 9 look overloaded (9 vs 0); the one with room carries 5: 9 vs 5 stays warm
    t = table(n1=[engine("W", in_flight=9)], n2=[engine("F", kv_used=0.99)], n3=[engine("R", in_flight=5)])
    assert chosen(t, req(session="s"), {"s": at(t, "W")}) == ("W", "session")
    t = table(n1=[engine("W", in_flight=9)], n2=[engine("F", kv_used=0.5)], n3=[engine("R", in_flight=5)])
    assert chosen(t, req(session="s"), {"s": at(t, "W")}) == ("F", "fallback")


def test_a_busy_warm_engine_falls_to_a_holder_with_room_not_to_an_idle_full_one():
    t = table(n1=[engine("W", in_flight=12)], n2=[engine("F", kv_used=0.99)], n3=[engine("R", in_flight=1)])
    assert chosen(t, req(session="s"), {"s": at(t, "W")}) == ("R", "fallback")


# --- the attack: a node's absurd figures ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lie",
    [
        {"slots_busy": -1_000_000, "queued": -1_000_000},
        {"queued": -(2**62)},
        {"kv_used": math.nan},
        {"kv_used": -math.inf},
        {"kv_used": -5.0},
        {"slots": -3, "slots_busy": -3, "queued": -3, "kv_used": math.nan},
    ],
)
def test_no_lie_makes_a_busy_engine_look_better_than_an_idle_one(lie):
    t = table(n1=[engine("L", in_flight=1, **lie)], n2=[engine("I")])
    v = t.engines["L"]
    assert v.load == 1 and v.reported == 0 and v.kv_used == 0.0 and v.slots == 1
    assert [chosen(t)[0] for _ in range(2)] == ["I", "L"]  # the idle one first; then 1 vs 1, in turn


@pytest.mark.parametrize(
    ("figures", "load", "kv"),
    [
        ({"slots_busy": 2**62, "queued": 2**62}, MAX_IN_FLIGHT, 0.0),
        ({"in_flight": 2**62, "queued": 5}, MAX_IN_FLIGHT, 0.0),
        ({"kv_used": math.inf}, 0, 1.0),
        ({"kv_used": 1e300}, 0, 1.0),
    ],
)
def test_huge_figures_are_clamped_and_only_make_the_liar_look_busier(figures, load, kv):
    t = table(n1=[engine("L", **figures)], n2=[engine("I", in_flight=3)])
    v = t.engines["L"]
    assert (v.load, v.kv_used) == (load, kv)
    assert chosen(t)[0] == "I"  # 3 in flight with room beats a clamped giant, or an idle one whose cache is full


def test_absurd_figures_off_the_wire_are_clamped_or_refused():
    def wire(**fields) -> bytes:
        base = {"engine_id": "L", "model": "m", "engine": "llama-server", "ops": ["chat"], "state": "ready"}
        hb = {"node_id": "n1", "version": "0", "seq": 1, "ts": 0.0, "host": "n1", "capabilities": []}
        return msgspec.json.encode({**hb, "engines": [{**base, **fields}]})

    hb = msgspec.json.decode(wire(slots_busy=-7, queued=2**63 - 1, kv_used=-0.5), type=Heartbeat)
    t = EngineTable()
    t.apply(hb, 0.0)
    assert (t.engines["L"].reported, t.engines["L"].kv_used) == (MAX_IN_FLIGHT, 0.0)
    t.apply(msgspec.json.decode(wire(kv_used=7), type=Heartbeat), 0.0)
    assert t.engines["L"].kv_used == 1.0 and t.engines["L"].kv_full
    # JSON has no NaN and no infinity: such a heartbeat does not decode, so it never reaches the table
    refused = {b"NaN": msgspec.DecodeError, b"1e999": msgspec.ValidationError, b'"full"': msgspec.ValidationError}
    for raw, error in refused.items():
        with pytest.raises(error):
            msgspec.json.decode(wire(kv_used=0.25).replace(b"0.25", raw), type=Heartbeat)


def test_an_engine_that_reports_nothing_routes_as_before():
    t = table(n1=[engine("A", in_flight=2)], n2=[engine("B", in_flight=1)])
    assert (t.engines["A"].reported, t.engines["A"].kv_used) == (0, 0.0)
    assert chosen(t) == ("B", "least_busy")
