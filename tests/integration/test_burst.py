"""A burst on a model with few slots queues while its expected wait is under the model's `queue_time_s`, and is
refused past it with a 429 whose `Retry-After` is that wait (issue 39: 16 chats on 2 slots got 429 once 8 were
queued, when the queue was a count). Real worker and `llama-server` children with two slots, the tiny GGUF, the
OpenAI SDK with its retries off, so every answer is the gateway's own."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow

BURST = 16


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf):
    from coderai.engine_worker.engines.llama_server import find_binary

    if find_binary() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    params = {"parallel": 2, "n_ctx": 512, "n_threads": 1}
    models = [
        {"name": "two-slots", "engine": "llama-server", "path": str(tiny_gguf), "params": params},
        # a budget no queue fits in: once a job's time is known, a request that must wait is refused
        {"name": "no-wait", "engine": "llama-server", "path": str(tiny_gguf), "params": params, "queue_time_s": 0.001},
    ]
    with running_stack(tmp_path_factory.mktemp("burst"), models, gateway_args=("--no-auth",)) as s:
        s.wait_model_ready("no-wait")
        yield s


def _burst(stack, model: str) -> list:
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=300)

    def one(i: int):
        try:
            return client.chat.completions.create(
                model=model, max_tokens=24, temperature=0, messages=[{"role": "user", "content": f"count to ten, {i}"}]
            )
        except openai.APIStatusError as exc:
            return exc

    with ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(one, range(BURST)))


def test_sixteen_chats_on_two_slots_all_queue_and_are_answered(stack):
    _burst(stack, "two-slots")  # a first burst teaches the worker how long a job holds a slot
    answers = _burst(stack, "two-slots")
    refused = [a for a in answers if isinstance(a, Exception)]
    assert not refused, [(a.status_code, a.message) for a in refused]
    assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)


def test_past_the_queue_time_budget_a_request_gets_429_with_the_expected_wait(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=300)
    client.chat.completions.create(model="no-wait", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    answers = _burst(stack, "no-wait")
    refused = [a for a in answers if isinstance(a, Exception)]
    served = [a for a in answers if not isinstance(a, Exception)]
    assert refused and served, "the slots take two at once; the rest would wait past the budget"
    for err in refused:
        assert (err.status_code, err.code) == (429, "busy"), err.body
        assert int(err.response.headers["retry-after"]) >= 1 and "queue_time_s" in err.message
