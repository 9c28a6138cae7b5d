"""A model's output limits on every API, through the official clients against a real stack (the tiny GGUF behind
llama-server): `max_output_tokens` caps what a request asks for (the answer ends as its API says a cut answer
does), and `default_output_tokens` applies when a request names no limit. Both are stated in `/v1/models`."""

from __future__ import annotations

import httpx
import pytest

from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow

CAP, DEFAULT = 6, 3
ASK = 200  # what each request asks for: far above the ceiling
PROMPT = "write a very long story about a cat"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf):
    from coderai.engine_worker.engines.llama_server import find_binary

    if find_binary() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    params = {"parallel": 1, "n_ctx": 512, "n_threads": 2}
    models = [
        {
            "name": "capped",
            "engine": "llama-server",
            "path": str(tiny_gguf),
            "params": params,
            "max_output_tokens": CAP,
            "default_output_tokens": DEFAULT,
        }
    ]
    with running_stack(tmp_path_factory.mktemp("limits"), models, gateway_args=("--no-auth",)) as s:
        yield s


def test_the_limits_are_stated_in_the_model_list(stack):
    import openai

    m = openai.OpenAI(base_url=stack.base_url, api_key="none").models.retrieve("capped")
    assert (m.max_output_tokens, m.default_output_tokens, m.context_length) == (CAP, DEFAULT, 512)


def test_chat_and_completions_are_capped_and_end_with_length(stack):
    import openai

    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0)
    chat = client.chat.completions.create(
        model="capped", max_tokens=ASK, temperature=0, messages=[{"role": "user", "content": PROMPT}]
    )
    assert chat.usage.completion_tokens == CAP and chat.choices[0].finish_reason == "length"
    newer = client.chat.completions.create(
        model="capped", max_completion_tokens=ASK, temperature=0, messages=[{"role": "user", "content": PROMPT}]
    )
    assert newer.usage.completion_tokens == CAP
    plain = client.completions.create(model="capped", prompt=PROMPT, max_tokens=ASK, temperature=0)
    assert plain.usage.completion_tokens == CAP and plain.choices[0].finish_reason == "length"
    unnamed = client.chat.completions.create(
        model="capped", temperature=0, messages=[{"role": "user", "content": PROMPT}]
    )
    assert unnamed.usage.completion_tokens <= DEFAULT


def test_responses_are_capped_and_incomplete(stack):
    import openai

    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0)
    r = client.responses.create(model="capped", input=PROMPT, max_output_tokens=ASK, temperature=0)
    assert r.usage.output_tokens == CAP
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_messages_are_capped_and_stop_at_max_tokens(stack):
    import anthropic

    client = anthropic.Anthropic(base_url=stack.http_url, api_key="none", max_retries=0)
    m = client.messages.create(
        model="capped",
        max_tokens=ASK,
        extra_body={"temperature": 0},  # not in its signature
        messages=[{"role": "user", "content": PROMPT}],
    )
    assert m.usage.output_tokens == CAP and m.stop_reason == "max_tokens"


def test_ollama_num_predict_is_capped(stack):
    import ollama

    client = ollama.Client(host=stack.http_url)
    r = client.chat(
        model="capped", messages=[{"role": "user", "content": PROMPT}], options={"num_predict": ASK, "temperature": 0}
    )
    assert r.eval_count == CAP and r.done_reason == "length"
    raw = httpx.post(
        f"{stack.http_url}/api/generate",
        timeout=60,
        json={"model": "capped", "prompt": PROMPT, "stream": False, "options": {"temperature": 0}},
    )
    assert raw.status_code == 200 and raw.json()["eval_count"] <= DEFAULT
