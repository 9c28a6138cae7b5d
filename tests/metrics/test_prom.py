"""Prometheus series: how one finished request or one heartbeat changes them."""

from __future__ import annotations

import msgspec

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from coderai.contracts import EngineStatus, Heartbeat, RequestCompleted
from coderai.contracts.nodes import EVICTED_MAX
from coderai.metrics.prom import Series
from coderai.testing.heartbeats import heartbeat


def done(**kw) -> RequestCompleted:
    base = dict(
        request_id="r",
        ts=0.0,
        key_name="alice",
        model="m",
        op="chat",
        status="ok",
        http_status=200,
        engine_id="e1",
        duration_s=0.3,
    )
    return RequestCompleted(**{**base, **kw})


def eng(eid: str, model: str = "m", in_flight: int = 0, served: int = 0) -> EngineStatus:
    return EngineStatus(
        engine_id=eid, model=model, engine="llama", ops=["chat"], state="ready", in_flight=in_flight, served=served
    )


def beat(node: str, *engines: EngineStatus, mem_free: int = 0) -> Heartbeat:
    return heartbeat(node, engines=list(engines), mem_free=mem_free)


def req_labels(key="alice", model="m", kind="chat", status="ok", engine="e1"):
    return {"key": key, "model": model, "kind": kind, "status": status, "engine": engine}


def test_series_uses_the_given_registry_or_a_private_one():
    reg = CollectorRegistry()
    assert Series(reg).registry is reg
    a, b = Series(), Series()
    assert a.registry is not b.registry  # two Series never clash on metric names


def test_on_request_counts_by_key_model_kind_status_and_engine():
    s = Series()
    s.on_request(done())
    s.on_request(done())
    s.on_request(done(status="timeout", http_status=504, engine_id="e2"))
    s.on_request(done(op="complete", key_name="bob"))
    get = s.registry.get_sample_value
    assert get("coderai_requests_total", req_labels()) == 2
    assert get("coderai_requests_total", req_labels(status="timeout", engine="e2")) == 1
    assert get("coderai_requests_total", req_labels(key="bob", kind="complete")) == 1
    assert get("coderai_requests_total", req_labels(key="bob")) is None


def test_on_request_observes_duration_by_model_kind_status():
    s = Series()
    s.on_request(done(duration_s=0.3))
    s.on_request(done(duration_s=2.0, engine_id="e2"))
    s.on_request(done(duration_s=9.0, status="engine_failed"))
    get = s.registry.get_sample_value
    ok = {"model": "m", "kind": "chat", "status": "ok"}
    assert get("coderai_request_seconds_count", ok) == 2
    assert get("coderai_request_seconds_sum", ok) == pytest.approx(2.3)
    assert get("coderai_request_seconds_bucket", {**ok, "le": "0.5"}) == 1
    assert get("coderai_request_seconds_bucket", {**ok, "le": "2.5"}) == 2
    assert get("coderai_request_seconds_count", {"model": "m", "kind": "chat", "status": "engine_failed"}) == 1


def test_tokens_are_counted_by_type_and_zero_counts_add_no_series():
    s = Series()
    s.on_request(done(prompt_tokens=10, completion_tokens=5))
    s.on_request(done(prompt_tokens=3, completion_tokens=0))
    get = s.registry.get_sample_value
    assert get("coderai_tokens_total", {"key": "alice", "model": "m", "type": "prompt"}) == 13
    assert get("coderai_tokens_total", {"key": "alice", "model": "m", "type": "completion"}) == 5
    s.on_request(done(key_name="bob"))
    assert get("coderai_tokens_total", {"key": "bob", "model": "m", "type": "prompt"}) is None
    assert get("coderai_tokens_total", {"key": "bob", "model": "m", "type": "completion"}) is None


def test_ttft_is_observed_only_for_successful_requests_that_have_one():
    s = Series()
    s.on_request(done(ttft_s=0.04))
    s.on_request(done(ttft_s=0.5, status="cancelled"))
    s.on_request(done(ttft_s=None))
    get = s.registry.get_sample_value
    labels = {"model": "m", "kind": "chat"}
    assert get("coderai_ttft_seconds_count", labels) == 1
    assert get("coderai_ttft_seconds_sum", labels) == pytest.approx(0.04)


def test_ttft_zero_is_still_observed():
    s = Series()
    s.on_request(done(ttft_s=0.0))
    assert s.registry.get_sample_value("coderai_ttft_seconds_count", {"model": "m", "kind": "chat"}) == 1


def test_on_heartbeat_sets_engine_and_node_gauges():
    s = Series()
    s.on_heartbeat(
        beat("n1", eng("e1", in_flight=3, served=10), eng("e2", model="x", in_flight=0, served=1), mem_free=1234)
    )
    get = s.registry.get_sample_value
    assert get("coderai_node_memory_free_bytes", {"node": "n1"}) == 1234
    assert get("coderai_engine_in_flight", {"node": "n1", "engine": "e1", "model": "m"}) == 3
    assert get("coderai_engine_served", {"node": "n1", "engine": "e1", "model": "m"}) == 10
    assert get("coderai_engine_in_flight", {"node": "n1", "engine": "e2", "model": "x"}) == 0
    assert get("coderai_engine_served", {"node": "n1", "engine": "e2", "model": "x"}) == 1
    s.on_heartbeat(beat("n1", eng("e1", in_flight=1, served=12), eng("e2", model="x"), mem_free=99))
    assert get("coderai_engine_in_flight", {"node": "n1", "engine": "e1", "model": "m"}) == 1
    assert get("coderai_engine_served", {"node": "n1", "engine": "e1", "model": "m"}) == 12
    assert get("coderai_node_memory_free_bytes", {"node": "n1"}) == 99


def test_engines_that_disappear_lose_their_series():
    s = Series()
    s.on_heartbeat(beat("n1", eng("e1", in_flight=2), eng("e2", in_flight=5)))
    s.on_heartbeat(beat("n2", eng("e9", in_flight=4)))
    s.on_heartbeat(beat("n1", eng("e1", in_flight=1)))
    get = s.registry.get_sample_value
    assert get("coderai_engine_in_flight", {"node": "n1", "engine": "e2", "model": "m"}) is None
    assert get("coderai_engine_served", {"node": "n1", "engine": "e2", "model": "m"}) is None
    assert get("coderai_engine_in_flight", {"node": "n1", "engine": "e1", "model": "m"}) == 1
    assert (
        get("coderai_engine_in_flight", {"node": "n2", "engine": "e9", "model": "m"}) == 4
    )  # another node's engines stay
    s.on_heartbeat(beat("n1"))
    assert get("coderai_engine_in_flight", {"node": "n1", "engine": "e1", "model": "m"}) is None
    assert b'engine="e1"' not in generate_latest(s.registry)


def test_an_engine_reloaded_with_another_model_drops_the_old_label_set():
    s = Series()
    s.on_heartbeat(beat("n1", eng("e1", model="a", in_flight=1)))
    s.on_heartbeat(beat("n1", eng("e1", model="b", in_flight=2)))
    get = s.registry.get_sample_value
    assert get("coderai_engine_in_flight", {"node": "n1", "engine": "e1", "model": "a"}) is None
    assert get("coderai_engine_in_flight", {"node": "n1", "engine": "e1", "model": "b"}) == 2


def test_an_engine_that_comes_back_is_reported_again():
    s = Series()
    s.on_heartbeat(beat("n1", eng("e1", in_flight=1)))
    s.on_heartbeat(beat("n1"))
    s.on_heartbeat(beat("n1", eng("e1", in_flight=6)))
    assert s.registry.get_sample_value("coderai_engine_in_flight", {"node": "n1", "engine": "e1", "model": "m"}) == 6


def test_route_decisions_are_counted_by_reason():
    s = Series()
    for reason in ("prefix", "prefix", "least_busy", ""):
        s.on_request(done(route_reason=reason))
    get = s.registry.get_sample_value
    assert get("coderai_route_decisions_total", {"reason": "prefix"}) == 2
    assert get("coderai_route_decisions_total", {"reason": "least_busy"}) == 1
    assert get("coderai_route_decisions_total", {"reason": ""}) is None  # no decision (e.g. rejected early)


def test_engine_prefix_cache_counters_come_from_the_heartbeat():
    s = Series()
    e = EngineStatus(
        engine_id="e1",
        model="m",
        engine="llama",
        ops=["chat"],
        state="ready",
        prompt_tokens=1000,
        cached_tokens=800,
        prefix_hits=7,
        cache_bytes=4096,
    )
    s.on_heartbeat(beat("n1", e))
    labels = {"node": "n1", "engine": "e1", "model": "m"}
    get = s.registry.get_sample_value
    assert get("coderai_engine_prompt_tokens", labels) == 1000
    assert get("coderai_engine_cached_prompt_tokens", labels) == 800
    assert get("coderai_engine_prefix_hits", labels) == 7
    assert get("coderai_engine_prompt_cache_bytes", labels) == 4096
    s.on_heartbeat(beat("n1"))
    assert get("coderai_engine_prefix_hits", labels) is None


def test_the_conversations_an_engine_cache_dropped_are_counted_once_each():
    s = Series()
    e = EngineStatus(engine_id="e1", model="m", engine="vllm", ops=["chat"], state="ready", evicted=["k1", "k2"])
    s.on_heartbeat(beat("n1", e))
    s.on_heartbeat(beat("n1", msgspec.structs.replace(e, evicted=[])))  # named once, in the heartbeat after
    s.on_heartbeat(beat("n1", msgspec.structs.replace(e, evicted=[f"x{i}" for i in range(1000)])))
    labels = {"node": "n1", "engine": "e1", "model": "m"}
    get = s.registry.get_sample_value
    assert get("coderai_engine_cache_evicted_keys_total", labels) == 2 + EVICTED_MAX  # a node's word, bounded
    s.on_heartbeat(beat("n1"))
    assert get("coderai_engine_cache_evicted_keys_total", labels) is None  # the engine went: so did its series


def test_spend_and_census():
    s = Series()
    s.on_request(done(cost_usd=0.25))
    s.on_request(done(cost_usd=0.5))
    get = s.registry.get_sample_value
    assert get("coderai_spend_usd_total", {"key": "alice", "model": "m"}) == 0.75
    ready = EngineStatus(engine_id="e1", model="m", engine="llama", ops=["chat"], state="ready")
    loading = EngineStatus(engine_id="e2", model="n", engine="llama", ops=["chat"], state="loading")
    s.census({"n1": beat("n1", ready), "n2": beat("n2", loading)})
    assert get("coderai_nodes_up") == 2 and get("coderai_engines_up", {"model": "m"}) == 1
    s.census({})
    assert get("coderai_nodes_up") == 0 and get("coderai_engines_up", {"model": "m"}) == 0


def test_fanout_parts_by_worker_and_redeliveries():
    from coderai.contracts import PartDone

    s = Series()
    s.on_request(
        RequestCompleted(
            request_id="r",
            ts=0,
            key_name="k",
            model="m",
            op="embed",
            status="ok",
            http_status=200,
            parts=3,
            route_reason="fanout",
        )
    )
    for node, status, deliveries in [("n1", "ok", 1), ("n2", "ok", 1), ("n1", "retry", 1), ("n2", "ok", 2)]:
        s.on_part(
            PartDone(
                request_id="r",
                model="m",
                op="embed",
                part=0,
                node_id=node,
                engine_id="e",
                status=status,
                deliveries=deliveries,
            )
        )
    text = generate_latest(s.registry).decode()
    assert 'coderai_fanout_parts_sent_total{kind="embed",model="m"} 3.0' in text
    assert 'coderai_fanout_parts_total{kind="embed",model="m",node="n2",status="ok"} 2.0' in text
    assert 'coderai_fanout_parts_total{kind="embed",model="m",node="n1",status="retry"} 1.0' in text
    assert 'coderai_fanout_redelivered_total{kind="embed",model="m"} 1.0' in text


def test_a_hot_node_shows_how_many_of_its_sensors_are_over_the_limit():
    s = Series()
    s.on_heartbeat(msgspec.structs.replace(beat("n1"), hot={"0": 92.0, "1": 95.5}))
    assert s.registry.get_sample_value("coderai_node_hot", {"node": "n1"}) == 2
    s.on_heartbeat(beat("n1"))  # cooled: the heartbeat leaves `hot` out
    assert s.registry.get_sample_value("coderai_node_hot", {"node": "n1"}) == 0
