"""Tracing: off costs nothing and loads nothing; the file exporter writes parented JSON lines; a missing OTLP
exporter is named in a warning."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from coderai.contracts.topology import HDR_TRACEPARENT
from coderai.runtime import tracing


@pytest.fixture
def clean_env(monkeypatch):
    for var in (tracing.ENV_TRACE_FILE, tracing.ENV_OTLP_ENDPOINT, tracing.ENV_OTLP_TRACES_ENDPOINT):
        monkeypatch.delenv(var, raising=False)
    tracing.shutdown_tracing()
    yield monkeypatch
    tracing.shutdown_tracing()


def test_off_returns_the_shared_no_op_and_leaves_headers_alone(clean_env):
    assert tracing.setup_tracing("router") is False
    assert not tracing.enabled()
    span = tracing.start_span("x", headers={HDR_TRACEPARENT: "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    assert span is tracing.NO_SPAN
    with span as s:
        s.set_attribute("a", 1)
        s.set_attributes({"b": 2})
    span.end()
    tracing.set_error(span, "nothing happens")
    headers = {"Coderai-Request-Id": "r1"}
    assert tracing.inject(span, headers) is headers and headers == {"Coderai-Request-Id": "r1"}


def test_off_never_imports_opentelemetry():
    code = (
        "import sys\n"
        "from coderai.runtime import tracing\n"
        "assert tracing.setup_tracing('gateway') is False\n"
        "tracing.start_span('x').end()\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in (tracing.ENV_TRACE_FILE, tracing.ENV_OTLP_ENDPOINT, tracing.ENV_OTLP_TRACES_ENDPOINT)
    }
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_file_exporter_writes_one_parented_line_per_span(clean_env, tmp_path):
    clean_env.setenv(tracing.ENV_TRACE_FILE, str(tmp_path / "spans" / "{service}.jsonl"))
    assert tracing.setup_tracing("gateway", "node-a") is True
    assert tracing.setup_tracing("other") is True  # once per process: the second call changes nothing

    root = tracing.start_span("POST /v1/chat/completions", kind="server", attributes={"coderai.model": "tiny"})
    headers = tracing.inject(root, {"Coderai-Request-Id": "r1"})
    assert headers[HDR_TRACEPARENT].startswith("00-") and headers["Coderai-Request-Id"] == "r1"
    with tracing.start_span("router.pick", headers=headers, kind="server") as remote:
        remote.set_attribute("coderai.route_reason", "least_busy")
    child = tracing.start_span("engine.call", parent=root, kind="client")
    tracing.set_error(child, "engine_failed")
    child.end()
    root.end()

    lines = [json.loads(x) for x in (tmp_path / "spans" / "gateway.jsonl").read_text().splitlines()]
    by_name = {s["name"]: s for s in lines}
    assert list(by_name) == ["router.pick", "engine.call", "POST /v1/chat/completions"]  # in the order they ended
    req, pick, call = by_name["POST /v1/chat/completions"], by_name["router.pick"], by_name["engine.call"]
    assert set(req) == {
        "trace_id",
        "span_id",
        "parent_id",
        "name",
        "service",
        "kind",
        "start_ns",
        "end_ns",
        "status",
        "status_message",
        "attributes",
    }
    assert len(req["trace_id"]) == 32 and len(req["span_id"]) == 16 and req["parent_id"] is None
    assert {s["trace_id"] for s in lines} == {req["trace_id"]}
    assert pick["parent_id"] == req["span_id"] and call["parent_id"] == req["span_id"]
    assert headers[HDR_TRACEPARENT].startswith(f"00-{req['trace_id']}-{req['span_id']}-")  # then the flags
    assert req["service"] == "gateway" and req["kind"] == "server" and call["kind"] == "client"
    assert req["attributes"] == {"coderai.model": "tiny"}
    assert pick["attributes"] == {"coderai.route_reason": "least_busy"}
    assert call["status"] == "error" and call["status_message"] == "engine_failed"
    assert 0 < req["start_ns"] <= call["start_ns"] <= call["end_ns"] <= req["end_ns"]


def test_missing_otlp_exporter_is_named(clean_env, caplog):
    clean_env.setenv(tracing.ENV_OTLP_ENDPOINT, "http://127.0.0.1:4318")
    clean_env.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)  # import fails
    with caplog.at_level(logging.WARNING, logger="coderai.tracing"):
        assert tracing.setup_tracing("router") is False
    assert not tracing.enabled() and tracing.start_span("x") is tracing.NO_SPAN
    assert tracing.OTLP_PACKAGE in caplog.text and "coderai[otel]" in caplog.text


def test_otlp_endpoint_receives_the_spans(clean_env):
    """A stand-in collector: the batch exporter posts protobuf to <endpoint>/v1/traces (flushed at shutdown)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    got: list[tuple[str, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # the http.server API
            got.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        clean_env.setenv(tracing.ENV_OTLP_ENDPOINT, f"http://127.0.0.1:{server.server_port}")
        assert tracing.setup_tracing("router") is True
        tracing.start_span("router.pick", kind="server").end()
        tracing.shutdown_tracing()
    finally:
        server.shutdown()
    assert [path for path, _ in got] == ["/v1/traces"]
    assert b"router.pick" in got[0][1] and b"router" in got[0][1]
