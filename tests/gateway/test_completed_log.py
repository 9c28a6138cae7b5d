"""The gateway's one line per completed request, and what the logging setup keeps quiet at INFO (the log budget;
tests/integration/test_log_budget.py checks it on a whole stack)."""

from __future__ import annotations

import io
import json
import logging

import pytest

from coderai.contracts import RequestCompleted
from coderai.gateway.accounting import log_completed
from coderai.runtime import logging as clog


@pytest.fixture
def json_lines(monkeypatch):
    """setup_logging as a service runs it, stderr captured; the root logger and the quieted ones put back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {n: logging.getLogger(n).level for n in ("nats", "asyncio", "gguf", "httpx", "httpcore")}
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    monkeypatch.setattr(clog, "_secrets", set())
    clog.setup_logging("gateway", "n1", "INFO", "json")
    yield lambda: [json.loads(line) for line in out.getvalue().splitlines()]
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, was in levels.items():
        logging.getLogger(name).setLevel(was)


def test_a_completed_request_is_one_json_line_with_its_fields(json_lines):
    clog.add_secret("sk-never-in-a-log-0123")
    done = RequestCompleted(
        request_id="r" * 24,
        ts=1.0,
        key_name="alice",
        model="tiny",
        op="chat",
        status="ok",
        http_status=200,
        engine_id="n1-tiny",
        node_id="n1",
        duration_s=0.25,
        ttft_s=0.0123,
        prompt_tokens=7,
        completion_tokens=3,
        stream=True,
        route_reason="prefix",
        parts=0,
        client_request_id="sk-never-in-a-log-0123",
    )
    log_completed(done)
    [line] = json_lines()
    assert line["msg"] == "request completed" and line["level"] == "info" and line["request_id"] == "r" * 24
    assert {
        k: line[k]
        for k in (
            "key_name",
            "model",
            "op",
            "status",
            "http_status",
            "stream",
            "route",
            "engine",
            "engine_node",
            "ttft_ms",
            "total_ms",
            "prompt_tokens",
            "completion_tokens",
        )
    } == {
        "key_name": "alice",
        "model": "tiny",
        "op": "chat",
        "status": "ok",
        "http_status": 200,
        "stream": True,
        "route": "prefix",
        "engine": "n1-tiny",
        "engine_node": "n1",
        "ttft_ms": 12.3,
        "total_ms": 250.0,
        "prompt_tokens": 7,
        "completion_tokens": 3,
    }
    assert line["client_request_id"] == "***"  # a secret is redacted wherever it turns up
    assert clog.ring.tail(1) == [json.dumps(line)]  # the admin API's ring has the same line


def test_httpx_request_lines_stay_below_info(json_lines):
    """The worker polls each llama-server's /metrics twice a second with httpx, which logs every request at INFO."""
    logging.getLogger("httpx").info('HTTP Request: GET http://127.0.0.1:1/metrics "HTTP/1.1 200 OK"')
    logging.getLogger("httpcore.connection").debug("connect_tcp.started")
    logging.getLogger("httpx").warning("kept")
    assert [line["msg"] for line in json_lines()] == ["kept"]
