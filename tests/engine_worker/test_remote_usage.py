"""A remote endpoint that reports no usage is still billed: the worker counts what it sent and what came back
(about four characters a token), whole and streamed; an endpoint's own counts always win."""

from __future__ import annotations

import pytest

from coderai.contracts import ChatJob, CompletionJob, ModelConfig, SamplingParams
from coderai.engine_worker.engines.base import CancelFlag
from coderai.engine_worker.engines.remote import RemoteEngine
from coderai.testing.fake_openai import FakeOpenAI

PROMPT = "Tell me about the weather in Lisbon in the spring, in some detail please."


@pytest.fixture(params=[False, True], ids=["silent", "reporting"])
def engine(request):
    with FakeOpenAI(reply="one two three four five six seven eight", usage=request.param) as server:
        eng = RemoteEngine(ModelConfig(name="far", engine="remote", path="-", params={"service_url": server.base_url}))
        eng.load()
        try:
            yield eng, request.param
        finally:
            eng.close()


def chat(stream: bool) -> ChatJob:
    return ChatJob(
        request_id="r1",
        model="far",
        messages=[{"role": "user", "content": PROMPT}],
        params=SamplingParams(max_tokens=8),
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_chat_is_billed_whether_or_not_the_endpoint_counts(engine, stream):
    eng, reporting = engine
    pieces: list[str] = []
    emit = (lambda delta, text, *_a, **_k: pieces.append((delta or {}).get("content") or "")) if stream else None
    _, usage = eng.chat(chat(stream), CancelFlag(), emit)
    if reporting:  # the endpoint's own figures, untouched (the fake counts words)
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT.split()), 8)
    else:
        assert usage.prompt_tokens >= len(PROMPT) // 4 and usage.completion_tokens >= 8
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if stream:
        assert "".join(pieces).split() == "one two three four five six seven eight".split()


def test_a_completion_without_usage_is_counted_too(engine):
    eng, reporting = engine
    _, usage = eng.complete(
        CompletionJob(request_id="r2", model="far", prompt=PROMPT, params=SamplingParams(max_tokens=4)),
        CancelFlag(),
        None,
    )
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    if not reporting:
        assert usage.prompt_tokens == -(-len(f'"{PROMPT}"') // 4)
