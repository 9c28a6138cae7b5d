"""The `mlx` family through the whole stack: a real mlx_lm.server (the `mlx` extra: `mlx[cpu]` + `mlx-lm` on this
Linux CPU) serving the tiny random HF llama, reached through the gateway with the OpenAI SDK, which names the
model by its coderai name (the worker sends the server the folder's path)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import openai
import pytest

from coderai.testing.stack import running_stack

pytest.importorskip("mlx.core", reason="the mlx extra is not installed")
pytest.importorskip("mlx_lm", reason="the mlx extra is not installed")

pytestmark = pytest.mark.slow

MODEL = "tiny-mlx"
PNG = (  # one white pixel
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4//8/AAX+Av4N70a4AAAAAElFTkSuQmCC"
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from coderai.testing.tiny_hf_llama import tiny_hf_llama

    model = {"name": MODEL, "engine": "mlx", "path": str(tiny_hf_llama()), "params": {"max_tokens": 32}}
    with running_stack(tmp_path_factory.mktemp("mlx"), [model], gateway_args=("--no-auth",)) as s:
        s.wait_engines_ready([MODEL], timeout_s=180)
        yield s


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)


def _children() -> list[list[str]]:
    """The argv of each live mlx_lm.server this test's worker started (mlx_serve.py, by path)."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = [a.decode() for a in Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if any(a.endswith("mlx_serve.py") for a in argv) and "--model" in argv:
            out.append(argv)
    return out


def test_chat_answers_with_usage_under_the_coderai_name(stack):
    r = _client(stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert r.model == MODEL and r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 8


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_stream_matches_the_whole_answer(stack, include_usage):
    client = _client(stack)
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 12, "temperature": 0}
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": include_usage}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    if include_usage:  # the worker always asks the server for it; the client gets it when it asked
        assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
        assert usage.prompt_tokens == whole.usage.prompt_tokens
    else:
        assert usage is None


def test_completions_whole_and_streamed(stack):
    client = _client(stack)
    whole = client.completions.create(model=MODEL, prompt="def f():", max_tokens=6, temperature=0)
    assert whole.choices[0].text and whole.usage is not None and whole.usage.completion_tokens <= 6
    chunks = list(client.completions.create(model=MODEL, prompt="def f():", max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_the_default_answer_length_is_the_models_max_tokens(stack):
    r = _client(stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0, logit_bias={"2": -100}
    )
    assert r.usage is not None and r.usage.completion_tokens == 32 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("ask", "param"),
    [
        ({"n": 2}, "n"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_what_it_cannot_do_is_a_400_naming_it(stack, ask, param):
    with pytest.raises(openai.BadRequestError) as err:
        _client(stack).chat.completions.create(
            **{"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **ask}
        )
    assert err.value.status_code == 400 and err.value.param == param


def test_an_empty_prompt_is_a_400_and_the_server_lives_on(stack):
    [before] = _children()
    with pytest.raises(openai.BadRequestError) as err:
        _client(stack).completions.create(model=MODEL, prompt="", max_tokens=4)
    assert "the prompt is empty" in str(err.value)
    assert _children() == [before]
    assert _client(stack).completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None


def test_a_local_user_cannot_use_the_child_directly(stack):
    """Attack: a local user reads the child's loopback port from `ps` and asks it for an answer (unbilled) or to
    load another folder. It wants a key only its worker knows, which is not in its argv."""
    [argv] = _children()
    assert not any("key" in a.lower() for a in argv), argv
    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    body = {"model": "/etc", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 401
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
