"""One trace per request across processes: gateway, router and worker each write their spans to their own file
(`CODERAI_TRACE_FILE=<dir>/{service}.jsonl`), joined by the `traceparent` header on the bus. The pick's span is
the gateway's own once its copy of the router's view is whole (gateway/picker.py), the router's before."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from coderai.contracts.topology import HDR_REQUEST_ID
from coderai.runtime.embedded import NatsServer
from coderai.testing.procs import wait_until
from coderai.testing.stack import Stack, write_models_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def traced(tmp_path_factory, tiny_gguf):
    root = tmp_path_factory.mktemp("tracing")
    spans = root / "spans"
    models = write_models_file(
        root / "models.toml",
        [
            {"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 512}},
        ],
    )
    nats = NatsServer(root / "nats").start()  # last: nothing that can fail runs before the `try` below
    stack = Stack(root, nats.url, extra_env={"CODERAI_TRACE_FILE": str(spans / "{service}.jsonl")})
    try:
        stack.start_core(models)
        stack.start_worker("w1")
        stack.start_gateway("--no-auth")
        stack.wait_model_ready("tiny")
        yield stack, spans
    finally:
        stack.stop()
        nats.stop()


def _spans(folder: Path) -> list[dict]:
    out = []
    for path in sorted(folder.glob("*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return out


def _whole_trace(folder: Path, request_id: str, op: str) -> dict[str, dict] | None:
    """The spans of this request's trace, by span id, once the gateway, router and worker have all written theirs."""
    spans = _spans(folder)
    roots = [
        s
        for s in spans
        if s["service"] == "gateway"
        and s["attributes"].get("coderai.request_id") == request_id
        and s["parent_id"] is None
    ]
    if not roots:
        return None
    trace = {s["span_id"]: s for s in spans if s["trace_id"] == roots[0]["trace_id"]}
    names = {(s["service"], s["name"]) for s in trace.values()}
    want = {("gateway", "route.pick"), ("gateway", "engine.call"), ("worker", f"engine.{op}")}
    # the pick itself: made by the gateway's copy of the router's view (gateway/picker.py), or by the router
    picked = {("gateway", "router.pick"), ("router", "router.pick")} & names
    return trace if want <= names and picked else None


def _ancestors(trace: dict[str, dict], span: dict) -> list[str]:
    chain, parent = [], span["parent_id"]
    while parent is not None:
        chain.append(trace[parent]["name"])  # a KeyError here is a parent outside the trace: wrong propagation
        parent = trace[parent]["parent_id"]
    return chain


def _check(trace: dict[str, dict], request_id: str, stream: bool) -> None:
    by_name = {s["name"]: s for s in trace.values()}
    [root] = [s for s in trace.values() if s["parent_id"] is None]
    assert root["name"] == "POST /v1/chat/completions" and root["kind"] == "server" and root["status"] != "error"
    a = root["attributes"]
    assert a["coderai.request_id"] == request_id and a["coderai.model"] == "tiny" and a["coderai.stream"] is stream
    assert (
        isinstance(a["coderai.key_name"], str) and a["coderai.status"] == "ok" and a["http.response.status_code"] == 200
    )
    assert a["coderai.prompt_tokens"] > 0 and a["coderai.engine_id"].startswith("w1-")

    pick = by_name["router.pick"]
    assert _ancestors(trace, pick) == ["route.pick", root["name"]]
    assert (
        pick["attributes"]["coderai.model"] == "tiny"
        and pick["attributes"]["coderai.engine_id"] == a["coderai.engine_id"]
    )
    assert pick["attributes"]["coderai.route_reason"]

    job = by_name["engine.chat"]
    assert _ancestors(trace, job) == ["engine.call", root["name"]]
    j = job["attributes"]
    assert j["coderai.engine_id"] == a["coderai.engine_id"] and j["coderai.request_id"] == request_id
    assert j["coderai.prompt_tokens"] > 0 and j["coderai.completion_tokens"] == a["coderai.completion_tokens"]
    assert j["coderai.ttft_s"] >= 0
    assert root["start_ns"] <= job["start_ns"] <= job["end_ns"] <= root["end_ns"] + 50_000_000  # clocks of one host


def test_chat_request_is_one_trace_across_gateway_router_and_worker(traced):
    stack, spans = traced
    r = httpx.post(
        f"{stack.base_url}/chat/completions",
        timeout=30,
        json={"model": "tiny", "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 4},
    )
    assert r.status_code == 200, r.text
    rid = r.headers[HDR_REQUEST_ID]
    trace = wait_until(lambda: _whole_trace(spans, rid, "chat"), 20, "spans from gateway, router and worker")
    _check(trace, rid, stream=False)


def test_streamed_chat_request_is_one_trace_too(traced):
    stack, spans = traced
    body = {"model": "tiny", "messages": [{"role": "user", "content": "stream me"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        rid = r.headers[HDR_REQUEST_ID]
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    trace = wait_until(lambda: _whole_trace(spans, rid, "chat"), 20, "spans from gateway, router and worker")
    _check(trace, rid, stream=True)
