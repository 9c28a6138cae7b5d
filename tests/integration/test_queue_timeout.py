"""A request that waits in an engine's queue longer than CODERAI_GATEWAY_QUEUE_TIMEOUT_S gets a clear 503 with
Retry-After, never a hang; the request that holds the slot is not disturbed, and the next one is served.

Real worker, a real `llama-server` child with one slot, the tiny GGUF."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow

# ~900 tokens of the tiny model, answered greedily up to max_tokens: the one slot stays busy for a second or more
LONG = " ".join(f"word{j}" for j in range(250))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf):
    from coderai.engine_worker.engines.llama_server import find_binary

    if find_binary() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    models = [
        {
            "name": "one-slot",
            "engine": "llama-server",
            "path": str(tiny_gguf),
            "params": {"parallel": 1, "n_ctx": 4096, "n_threads": 2, "queue": 4},
        }
    ]
    # the first queued keep-alive (0.1 s) is past the timeout: the long request need only outlast it by that much
    env = {
        "CODERAI_GATEWAY_QUEUE_TIMEOUT_S": "0.05",
        "CODERAI_WORKER_KEEPALIVE_S": "0.1",
        "CODERAI_WORKER_HEARTBEAT_S": "0.2",
    }
    with running_stack(
        tmp_path_factory.mktemp("queue-timeout"), models, gateway_args=("--no-auth",), extra_env=env
    ) as s:
        yield s


def _busy(stack) -> bool:
    nodes = httpx.get(f"{stack.http_url}/admin/nodes", timeout=10).json()["nodes"]
    return any(e.get("in_flight", 0) >= 1 for n in nodes for e in n["heartbeat"].get("engines", []))


def test_a_request_queued_too_long_gets_a_503_and_the_running_one_finishes(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)
    long_answer: list = []

    def hold_the_slot() -> None:
        long_answer.append(client.completions.create(model="one-slot", prompt=LONG, max_tokens=3000, temperature=0))

    holder = threading.Thread(target=hold_the_slot)
    holder.start()
    try:
        wait_until(lambda: _busy(stack), 30, "the long request to take the slot")
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="one-slot", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    finally:
        holder.join(120)
    assert err.value.status_code == 503 and err.value.code == "overloaded", err.value.body
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert "CODERAI_GATEWAY_QUEUE_TIMEOUT_S" in err.value.message
    assert long_answer and long_answer[0].choices[0].finish_reason in ("stop", "length")
    # the slot is free again: the next request is served
    r = client.chat.completions.create(model="one-slot", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].finish_reason in ("stop", "length")


def test_an_image_for_a_text_only_model_is_refused_before_it_queues(stack):
    """What a model cannot read is answered on arrival, not after a wait for a busy slot (nor as the queue's 503)."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)
    long_answer: list = []
    holder = threading.Thread(
        target=lambda: long_answer.append(
            client.completions.create(model="one-slot", prompt=LONG, max_tokens=3000, temperature=0)
        )
    )
    holder.start()
    try:
        wait_until(lambda: _busy(stack), 30, "the long request to take the slot")
        pixel = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="one-slot",
                max_tokens=4,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{pixel}"}},
                        ],
                    }
                ],
            )
        refused_while_busy = not long_answer  # the slot's request was still running when the refusal came
    finally:
        holder.join(120)
    assert err.value.param == "messages[0].content[1]" and "does not take images" in err.value.message, err.value.body
    assert refused_while_busy
