"""What Open WebUI 0.12.4 sent to coderai, recorded by test_open_webui.py's proxy (tests/integration/data/
open_webui_0.12.4/, credentials left out), sent again unchanged to a real stack with the same models: each answer
must have the status and content type Open WebUI got, and the shape and fields it reads (its Ollama router reads
`/api/tags`' `models[].model`, streams `/api/chat` line by line until `done`, and shows `/api/pull`'s `status`,
`completed` and `total`; its OpenAI router reads `/v1/models`' `data[].id` and SSE `choices[].delta`).

The real Open WebUI runs only behind CODERAI_TEST_OPEN_WEBUI=1 (a 7.4 GB install); this runs in every run."""

from __future__ import annotations

import json

import httpx
import pytest
from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.testing import open_webui as owui
from coderai.testing.fake_hub import FakeHub, hub_env
from coderai.testing.recording_proxy import body_from_record
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow
KEY = "sk-open-webui-replay-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
# the order they were recorded in: the pull's model must exist before its delete
SCENARIOS = [
    s
    for s in ("models", "chat_openai", "chat_ollama", "image_refused", "pull", "delete")
    if s in owui.recording_names()
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf):
    from coderai.engine_worker.engines.llama_server import find_binary

    if find_binary() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    hub = FakeHub()
    hub.add(owui.CATALOGUE_REPO, {owui.CATALOGUE_FILE: tiny_gguf.read_bytes()})
    root = tmp_path_factory.mktemp("open-webui-replay")
    keys = root / "keys.toml"
    write_keys(str(keys), [KeyRecord("open-webui", hash_key(KEY), ["inference", "admin"])])
    extra = {"CODERAI_WORKER_FAMILIES": "echo,llama-server", **hub_env(hub, str(root / "hf"))}
    try:
        with running_stack(
            root, owui.models(tiny_gguf), gateway_args=("--api-keys-file", str(keys)), extra_env=extra, headers=AUTH
        ) as s:
            s.wait_engines_ready([owui.ECHO, owui.TEXT_ONLY], headers=AUTH)
            yield s
    finally:
        hub.close()


def _send(stack, exchange: dict) -> httpx.Response:
    body = body_from_record(exchange["body"])
    with httpx.Client(base_url=stack.http_url, timeout=120) as client:
        r = client.request(
            exchange["method"], exchange["path"], headers={**exchange["headers"], **AUTH}, content=body or None
        )
        r.read()
        return r


def _ndjson(r: httpx.Response) -> list[dict]:
    lines = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    assert lines, r.text
    return lines


def _sse(r: httpx.Response) -> list[dict]:
    data = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", r.text[-500:]
    return [json.loads(d) for d in data[:-1]]


def _check(exchange: dict, r: httpx.Response) -> None:
    """The answer Open WebUI needs for this request (what it got when it was recorded)."""
    want = exchange["response"]
    path = exchange["path"].split("?")[0]
    what = f"{exchange['method']} {exchange['path']}"
    assert r.status_code == want["status"], (what, r.status_code, r.text[:500])
    assert r.headers.get("content-type", "").split(";")[0] == want["content_type"].split(";")[0], (what, r.headers)
    body = exchange["body"] if isinstance(exchange["body"], dict) else {}
    if r.status_code >= 400:
        err = r.json()["error"]  # Ollama's shape is a string, OpenAI's an object with a message
        message = err if path.startswith("/api/") else err["message"]
        assert isinstance(message, str) and message, r.text
        recorded = json.loads(want["head"])["error"]
        assert (recorded if isinstance(recorded, str) else recorded["message"]).split(" (")[0] in message, (
            what,
            r.text,
        )
        return
    if path == "/v1/models":
        assert {owui.ECHO, owui.TEXT_ONLY} <= {m["id"] for m in r.json()["data"]}, r.text
    elif path in ("/api/tags", "/api/ps"):
        models = r.json()["models"]
        assert all(isinstance(m["model"], str) and isinstance(m["name"], str) for m in models), r.text
        if path == "/api/tags":
            assert {owui.ECHO, owui.TEXT_ONLY} <= {m["model"] for m in models}, r.text
            assert all(m["size"] >= 0 and m["digest"] and m["details"]["family"] for m in models), r.text
    elif path == "/api/version":
        assert r.json()["version"], r.text
    elif path == "/api/chat":
        lines = _ndjson(r) if body.get("stream", True) else [r.json()]
        assert lines[-1]["done"] is True and not any(line["done"] for line in lines[:-1]), lines
        assert all(line["message"]["role"] == "assistant" for line in lines), lines
        assert "".join(line["message"].get("content", "") for line in lines), lines
        assert lines[-1]["eval_count"] >= 1 and lines[-1]["eval_duration"] > 0, lines[-1]
        if body.get("stream", True):
            assert len(lines) >= 3, "a stream, not one line"
    elif path == "/v1/chat/completions":
        if body.get("stream"):
            chunks = _sse(r)
            assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]), chunks
            assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks), chunks
        else:
            assert r.json()["choices"][0]["message"]["content"], r.text
    elif path == "/api/pull":
        lines = _ndjson(r)
        assert lines[-1] == {"status": "success"}, lines[-3:]
        sized = [line for line in lines if "total" in line]
        assert sized and all(0 <= line.get("completed", 0) <= line["total"] for line in sized), lines
        assert all(isinstance(line["status"], str) for line in lines), lines


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_recorded_requests_get_the_answers_open_webui_needs(stack, scenario):
    exchanges = owui.load_recording(scenario)
    assert exchanges
    for exchange in exchanges:
        assert "authorization" not in exchange["headers"]  # recordings carry no credentials
        _check(exchange, _send(stack, exchange))


def test_every_scenario_is_recorded():
    assert SCENARIOS == ["models", "chat_openai", "chat_ollama", "image_refused", "pull", "delete"], (
        f"recordings in {owui.RECORDINGS}: {owui.recording_names()}; record them with CODERAI_TEST_OPEN_WEBUI=1 "
        "CODERAI_TEST_OPEN_WEBUI_RECORD=1 pytest -m slow tests/integration/test_open_webui.py"
    )
