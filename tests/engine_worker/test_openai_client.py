"""OpenAIClient against a stand-in OpenAI-compatible server started in the test (coderai.testing.fake_openai): jobs
become requests (model, sampling, the request id, the key), answers and streams come back as choices and usage,
cancel drops the stream, and the server's errors are the worker's."""

from __future__ import annotations

import socket

import pytest

from coderai.contracts import ChatJob, CompletionJob, SamplingParams
from coderai.engine_worker.engines.base import BadInput, CancelFlag
from coderai.engine_worker.engines.openai_client import OpenAIClient, PromptCounters
from coderai.testing.fake_openai import REPLY, FakeOpenAI

KEY = "sk-test"


@pytest.fixture
def fake():
    with FakeOpenAI(key=KEY) as server:
        yield server


@pytest.fixture
def client(fake):
    c = OpenAIClient(fake.base_url, "m", headers={"Authorization": f"Bearer {KEY}"}, label="fake")
    yield c
    c.close()


def chat(content: str = "hi there", stream: bool = False, **params) -> ChatJob:
    return ChatJob(
        request_id="rid-1",
        model="m",
        messages=[{"role": "user", "content": content}],
        stream=stream,
        params=SamplingParams(**params),
    )


def test_a_chat_job_is_answered_whole_with_its_usage(fake, client):
    choices, usage = client.chat(chat(temperature=0.0), CancelFlag(), None)
    assert [c.message for c in choices] == [{"role": "assistant", "content": REPLY}]
    assert choices[0].finish_reason == "stop"
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, usage.cached_tokens) == (2, 5, 7, 0)
    path, headers, body = fake.seen[-1]
    assert path == "/v1/chat/completions" and headers["X-Request-Id"] == "rid-1"
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi there"}], "temperature": 0.0}
    client.chat(chat(), CancelFlag(), None)  # the same prompt again: the server had it cached
    assert client.counters.stats() == {"prompt_tokens": 4, "cached_tokens": 2, "prefix_hits": 1, "cache_bytes": 0}


def test_a_streamed_chat_comes_as_deltas_then_its_finish_and_usage(client):
    pieces: list[tuple] = []
    choices, usage = client.chat(
        chat(stream=True, max_tokens=3), CancelFlag(), lambda d, t, f: pieces.append((d, t, f))
    )
    assert choices == []
    assert pieces[0] == ({"role": "assistant", "content": "Hello"}, None, None)
    assert "".join((d or {}).get("content", "") for d, _, _ in pieces) == "Hello from the"
    assert pieces[-1] == (None, None, "length") and usage.completion_tokens == 3 and usage.prompt_tokens == 2


def test_a_caller_may_send_its_own_body_and_a_completion_job_too(fake, client):
    job = chat()
    client.chat(job, CancelFlag(), None, body={"model": "m", "messages": job.messages, "cache_salt": "k"})
    assert fake.seen[-1][2]["cache_salt"] == "k"
    done = CompletionJob(request_id="c", model="m", prompt="def f():", params=SamplingParams(max_tokens=2))
    choices, usage = client.complete(done, CancelFlag(), None)
    assert choices[0].text == "Hello from" and choices[0].finish_reason == "length" and usage.completion_tokens == 2
    texts: list = []
    client.complete(done, CancelFlag(), lambda d, t, f: texts.append(t))
    assert "".join(t or "" for t in texts) == "Hello from"


def test_several_choices_whole_are_streamed_and_put_together(fake, client):
    choices, usage = client.chat(chat(n=2, max_tokens=2), CancelFlag(), None)
    assert fake.seen[-1][2]["stream"] is True  # one choice's usage in a whole answer would undercount
    assert choices[0].message == {"role": "assistant", "content": "Hello from"} and usage.completion_tokens == 2


def test_cancel_ends_the_stream_and_the_server_sees_the_client_leave(fake, client):
    cancel = CancelFlag()
    seen: list = []

    def emit(delta, text, finish):
        seen.append(delta)
        if len(seen) == 3:
            cancel.set()

    _, usage = client.chat(chat(stream=True, max_tokens=1_000_000), cancel, emit)
    assert len(seen) == 3 and usage.completion_tokens == 3  # no usage event came: one piece is one token
    assert fake.dropped.wait(30), "the server never saw the client go away"
    assert client.chat(chat(), CancelFlag(), None)[0][0].message["content"] == REPLY  # a new connection serves on


@pytest.mark.parametrize("stream", [False, True])
def test_the_servers_errors_are_the_workers(client, stream):
    emit = (lambda d, t, f: None) if stream else None
    with pytest.raises(BadInput) as bad:
        client.chat(chat("please fail:400"), CancelFlag(), emit)
    assert bad.value.param == "messages" and "fake: failed as asked (400)" in str(bad.value)
    with pytest.raises(RuntimeError, match="fake answered 500"):
        client.chat(chat("please fail:500"), CancelFlag(), emit)


def test_a_wrong_key_is_refused_by_the_server(fake):
    c = OpenAIClient(fake.base_url, "m", label="fake")
    try:
        with pytest.raises(RuntimeError, match="fake answered 401"):
            c.chat(chat(), CancelFlag(), None)
    finally:
        c.close()


def test_a_base_url_with_a_prefix_and_a_shared_counter(fake):
    counters = PromptCounters()
    c = OpenAIClient(fake.base_url + "/openai/", "m", headers={"Authorization": f"Bearer {KEY}"}, counters=counters)
    try:
        c.chat(chat(), CancelFlag(), None)
        assert c.post_json("/v1/completions", {"model": "m", "prompt": "x"}, "r")["choices"][0]["text"] == REPLY
    finally:
        c.close()
    assert [s[0] for s in fake.seen] == ["/openai/v1/chat/completions", "/openai/v1/completions"]
    assert counters.prompt_tokens == 2


def test_an_unreachable_server_says_so_with_the_owners_word():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once it is closed
    c = OpenAIClient(f"http://127.0.0.1:{port}", "m", label="fake", state=lambda: "it exited")
    try:
        for emit in (None, lambda d, t, f: None):
            with pytest.raises(RuntimeError, match=r"^fake unreachable \(.*\); it exited$"):
                c.chat(chat(), CancelFlag(), emit)
    finally:
        c.close()
    with pytest.raises(ValueError, match="not an http"):
        OpenAIClient("ftp://x", "m")
