"""Faults: a worker dies mid-request, NATS dies and comes back. Clients get clear errors, never a hang,
and the stack recovers by itself."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from coderai.runtime.embedded import free_port
from coderai.testing.procs import wait_until
from coderai.testing.stack import Stack, running_stack

pytestmark = pytest.mark.slow

LONG = {"model": "tiny", "messages": [{"role": "user", "content": "keep going"}], "max_tokens": 7000, "temperature": 0}


@pytest.fixture(scope="module")
def fault_stack(tmp_path_factory, tiny_gguf, keys_file, admin_key):
    models = [{"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 8192}}]
    with running_stack(
        tmp_path_factory.mktemp("faults"),
        models,
        gateway_args=("--api-keys-file", str(keys_file)),
        extra_env={"CODERAI_GATEWAY_IDLE_TIMEOUT_S": "2", "CODERAI_WORKER_LOG_LEVEL": "DEBUG"},
        nats_port=free_port(),  # a fixed port, so NATS can come back on it
        headers={"Authorization": f"Bearer {admin_key}"},
    ) as stack:
        yield stack


@pytest.fixture
def client(fault_stack, admin_key):
    return openai.OpenAI(base_url=fault_stack.base_url, api_key=admin_key, max_retries=0, timeout=60)


def _restart_worker(stack: Stack, admin_key: str) -> None:
    stack.start_worker("w1")
    stack.wait_model_ready("tiny", headers={"Authorization": f"Bearer {admin_key}"})


def test_worker_killed_mid_stream_gives_an_error_not_a_hang(fault_stack, client, admin_key):
    stream = client.chat.completions.create(stream=True, **LONG)
    got = 0
    with pytest.raises(openai.APIError) as exc:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got += 1
                if got == 3:
                    fault_stack.procs["worker-w1"].kill()
    assert got >= 3
    assert "silent" in str(exc.value) or "engine" in str(exc.value)
    _restart_worker(fault_stack, admin_key)


def test_worker_killed_mid_answer_is_502(fault_stack, client, admin_key):
    worker = fault_stack.procs["worker-w1"]
    mark = len(worker.log_text())
    result: dict = {}

    def call():
        try:
            client.chat.completions.create(**LONG)
        except openai.APIStatusError as e:
            result["status"], result["body"] = e.status_code, e.body

    t = threading.Thread(target=call)
    t.start()
    worker.wait_log('"msg": "chat job started"', 30, after=mark)
    worker.kill()
    t.join(30)
    assert not t.is_alive(), "the client hung"
    assert result["status"] == 502 and result["body"]["code"] == "engine_failed"
    _restart_worker(fault_stack, admin_key)


def test_nats_outage_is_503_then_answers_resume_within_5s(fault_stack, admin_key):
    headers = {"Authorization": f"Bearer {admin_key}"}
    url = f"{fault_stack.base_url}/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(url, json=body, headers=headers, timeout=30).status_code == 200

    fault_stack.nats.kill()
    r = wait_until(
        lambda: (resp := httpx.post(url, json=body, headers=headers, timeout=10)).status_code == 503 and resp,
        10,
        "a 503 during the outage",
    )
    assert int(r.headers["Retry-After"]) > 0 and r.json()["error"]["code"] == "no_engine"

    fault_stack.nats.start()
    restarted = time.monotonic()
    wait_until(
        lambda: httpx.post(url, json=body, headers=headers, timeout=5).status_code == 200,
        5,
        "a normal answer within 5 s of NATS coming back",
    )
    assert time.monotonic() - restarted <= 5.5
    # and the stack keeps working: a streamed answer too
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=10) as s:
        assert s.status_code == 200 and s.read().endswith(b"data: [DONE]\n\n")
