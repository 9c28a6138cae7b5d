"""What a server child says about its own load (issue 44, item 3): requests running, requests waiting and the share of
its KV cache they hold, read from llama-server's /metrics and /slots and vLLM's /metrics, into the heartbeat.

The parsers on the text each server writes (llama.cpp with and without its old KV metric, vLLM before and after
the metric's rename), then a real llama-server on the tiny GGUF with one slot and several requests at once: its
heartbeat says one slot busy, the rest queued and a KV share, and the router's table counts them."""

from __future__ import annotations

import math
import threading

import msgspec
import pytest

from coderai.contracts import ChatJob, Heartbeat, ModelConfig, SamplingParams
from coderai.engine_worker.engines.base import CancelFlag
from coderai.engine_worker.engines.server_load import (
    MAX_COUNT,
    LoadPoll,
    ServerLoad,
    llama_load,
    read_llama,
    samples,
    slots_kv,
    vllm_load,
)
from coderai.testing.procs import wait_until

LLAMA_NOW = """# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
llamacpp:n_busy_slots_per_decode 1
"""
LLAMA_OLD = LLAMA_NOW + "llamacpp:kv_cache_usage_ratio 0.42\nllamacpp:kv_cache_tokens 860\n"


def slot(n_ctx: int, tokens: int, processing: bool) -> dict:
    return {"id": 0, "n_ctx": n_ctx, "n_prompt_tokens": tokens, "is_processing": processing, "params": {}}


def test_llama_server_load_from_its_metrics_and_slots():
    assert llama_load(LLAMA_NOW) == ServerLoad(1, 3, 0.0)  # no KV metric in this build, no /slots given: unknown
    # the running slot holds 1024 of its 2048; the idle one's cached prompt is room the next request may take
    slots = [slot(2048, 1024, True), slot(2048, 2000, False)]
    assert llama_load(LLAMA_NOW, slots) == ServerLoad(1, 3, 0.25)
    assert llama_load(LLAMA_OLD, slots).kv_used == 0.42  # an older build's own ratio wins
    assert ServerLoad(1, 3, 0.25).stats() == {"slots_busy": 1, "queued": 3, "kv_used": 0.25}


@pytest.mark.parametrize(
    "slots",
    [None, {}, "x", [1, "a", None], [slot(0, 5, True)], [{"n_ctx": "2048", "n_prompt_tokens": 9, "is_processing": 1}]],
)
def test_a_slots_answer_of_another_shape_leaves_the_kv_share_unknown(slots):
    assert slots_kv(slots) == 0.0


def test_a_slots_count_is_bounded_by_its_context():
    assert slots_kv([slot(100, 10**9, True), slot(100, -50, True)]) == 0.5


VLLM_V1 = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.7
"""
VLLM_V0 = """vllm:num_requests_running{model_name="tiny"} 2.0
vllm:num_requests_waiting{model_name="tiny"} 1.0
vllm:gpu_cache_usage_perc{model_name="a {b} c"} 0.93
"""


def test_vllm_load_from_its_metrics_before_and_after_the_rename():
    load = vllm_load(VLLM_V1)
    assert (load.running, load.waiting, round(load.kv_used, 6)) == (5, 4, 0.6)  # summed over engines, KV their mean
    assert vllm_load(VLLM_V0) == ServerLoad(2, 1, 0.93)
    assert vllm_load("") == ServerLoad()


def test_the_metrics_parser_takes_only_numbers_it_can_use():
    text = "\n".join(
        [
            "vllm:num_requests_running NaN",
            "vllm:num_requests_running +Inf",
            "vllm:num_requests_waiting -4",
            "vllm:num_requests_waiting{",
            "vllm:kv_cache_usage_perc 7",
            "vllm:num_requests_running_total 99",
            "garbage line",
        ]
    )
    assert samples(text, ["vllm:num_requests_running"]) == {}
    assert vllm_load(text) == ServerLoad(0, 0, 1.0)  # a negative count is none; a share past 1 is full
    assert vllm_load("vllm:num_requests_waiting 1e300").waiting == MAX_COUNT
    assert llama_load("llamacpp:kv_cache_usage_ratio NaN").kv_used == 0.0
    assert not math.isnan(llama_load("llamacpp:kv_cache_usage_ratio nan", [slot(10, 5, True)]).kv_used)


# --- a real llama-server ----------------------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You answer at length. " * 20}


@pytest.fixture(scope="module")
def one_slot(tiny_gguf):
    from coderai.engine_worker.engines import llama_server

    if llama_server.find_binary() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    cfg = ModelConfig(
        name="m",
        engine="llama-server",
        path=str(tiny_gguf),
        params={"parallel": 1, "n_ctx": 2048, "n_threads": 1, "head_snapshots_mb": 0},
    )
    eng = llama_server.LlamaServerEngine(cfg)
    eng.load()
    yield cfg, eng
    eng.close()


class Load:
    """`n` threads that keep the engine busy with long streamed chat turns (at most `limit` each) until the block
    ends, which cancels them (the stream's connection dropped: the server aborts the request)."""

    def __init__(self, eng, n: int, limit: int = 200) -> None:
        eos = eng.post_json("/tokenize", {"content": "<|im_end|>", "parse_special": True}, "t")["tokens"]
        # no end of turn: each turn runs its whole max_tokens
        self.params = SamplingParams(max_tokens=1500, temperature=0, logit_bias={str(eos[0]): -100.0})
        self.eng, self.limit, self.cancel = eng, limit, CancelFlag()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._ask, args=(i,), daemon=True) for i in range(n)]

    def _ask(self, i: int) -> None:
        try:
            for k in range(self.limit):
                if self.cancel:
                    return
                job = ChatJob(
                    request_id=f"r{i}-{k}",
                    model="m",
                    messages=[SYSTEM, {"role": "user", "content": f"tell me about {i} {k}"}],
                    params=self.params,
                )
                self.eng.chat(job, self.cancel, lambda *_a, **_k: None)
        except BaseException as exc:
            self.errors.append(exc)

    def running(self) -> bool:
        """True while every thread is still asking (an error fails the wait at once, naming it)."""
        if self.errors:
            raise AssertionError(f"a request failed: {self.errors[0]!r}")
        return True

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.cancel.set()
        for t in self.threads:
            t.join(120)
        assert not [t for t in self.threads if t.is_alive()], "a request did not end"
        assert not self.errors, self.errors


def test_a_llama_server_heartbeat_carries_its_busy_slot_queue_and_kv_while_requests_run(one_slot):
    from coderai.engine_worker.host import EngineHost
    from coderai.router.picking import EngineTable

    cfg, eng = one_slot
    host = EngineHost(None, "n1", cfg, 1.0)  # the worker's view of the engine, as its heartbeat reads it
    host.engine, host.state = eng, "ready"

    def busy():
        s = host.status()
        return s if load.running() and s.slots_busy == 1 and s.queued >= 1 and s.kv_used > 0 else None

    with Load(eng, 4) as load:
        status = wait_until(busy, 60, "one slot busy, requests queued behind it and a KV share, in the heartbeat")
    assert status.slots == 1 and 0 < status.kv_used <= 1 and status.queued <= 3
    print(f"while four asked one slot: slots_busy={status.slots_busy} queued={status.queued} kv_used={status.kv_used}")

    # through the wire to the router's table: the worker's own count of this engine was 0 (the test asked the engine
    # itself), yet the router counts what the server said it runs and holds
    hb = Heartbeat(node_id="n1", version="0", seq=1, ts=0.0, host="n1", capabilities=[], engines=[status])
    table = EngineTable()
    table.apply(msgspec.json.decode(msgspec.json.encode(hb), type=Heartbeat), 0.0)
    view = table.engines[status.engine_id]
    assert status.in_flight == 0 and view.load == 1 + status.queued and view.kv_used == status.kv_used

    # idle again: nothing runs or waits, and the cached prompt the slot keeps is not counted as used
    idle = wait_until(
        lambda: (s := host.status()).slots_busy == 0 and s.queued == 0 and s.kv_used == 0 and s, 60, "idle"
    )
    assert idle.kv_used == 0.0


def test_a_load_poll_reads_a_real_server_on_its_own_thread_and_stops(one_slot):
    _, eng = one_slot
    poll = LoadPoll(eng.child, read_llama, poll_s=0.1)
    try:
        with Load(eng, 3) as asking:

            def polled():
                now = poll.load
                return now if asking.running() and now.running == 1 and now.waiting >= 1 else None

            load = wait_until(polled, 60, "the poll's read of one slot busy and requests queued")
        assert load.kv_used > 0
    finally:
        poll.stop()
    assert not poll._thread.is_alive()


def test_the_supervisor_closes_the_server_connections_left_idle(one_slot):
    """A connection kept after a request and then left unused is closed by the engine's supervisor (which polls
    the child every half second), not held until the next request: a worker's fds shrink back after a burst."""
    _, eng = one_slot
    http = eng.client.http
    was, http.idle_s = http.idle_s, 3600.0
    try:
        assert eng.post_json("/tokenize", {"content": "hi"}, "t")["tokens"]
        assert http._idle  # kept
        http.idle_s = 0.0
        wait_until(lambda: not http._all, 30, "the supervisor to close the idle connection")
        assert eng.post_json("/tokenize", {"content": "hi"}, "t")["tokens"]  # a new one serves the next request
    finally:
        http.idle_s = was
