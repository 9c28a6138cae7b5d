"""The echo test engine: fixed replies, streamed or not, and offered by a worker only when named."""

from __future__ import annotations

import time

from coderai.contracts import ChatJob, CompletionJob, ModelConfig, SamplingParams
from coderai.engine_worker.engines import available_families, engine_class
from coderai.engine_worker.engines.base import CancelFlag
from coderai.engine_worker.settings import WorkerSettings
from coderai.runtime.settings import load_settings
from coderai.engine_worker.engines.echo import DEFAULT_REPLY, EchoEngine

CONFIG = ModelConfig(name="echo", engine="echo", path="-")


def _engine(**params) -> EchoEngine:
    eng = EchoEngine(ModelConfig(name="echo", engine="echo", path="-", params=params))
    eng.load()
    return eng


def _chat(max_tokens=None, n=1, stream=False) -> ChatJob:
    return ChatJob(request_id="r", model="echo", messages=[{"role": "user", "content": "two words"}],
                   params=SamplingParams(max_tokens=max_tokens, n=n), stream=stream)


def test_chat_without_max_tokens_is_the_reply_once():
    choices, usage = _engine().chat(_chat(), CancelFlag(), None)
    assert [c.message for c in choices] == [{"role": "assistant", "content": DEFAULT_REPLY}]
    assert choices[0].finish_reason == "stop"
    assert (usage.prompt_tokens, usage.completion_tokens) == (2, len(DEFAULT_REPLY.split()))


def test_chat_max_tokens_repeats_words_and_n_choices():
    choices, usage = _engine(reply="a b").chat(_chat(max_tokens=5, n=2), CancelFlag(), None)
    assert [c.message["content"] for c in choices] == ["a b a b a"] * 2
    assert [c.index for c in choices] == [0, 1]
    assert choices[0].finish_reason == "length"
    assert usage.completion_tokens == 10 and usage.total_tokens == 12


def test_chat_streams_role_then_one_delta_per_token_then_finish():
    frames = []
    choices, usage = _engine(reply="x y").chat(_chat(max_tokens=3, stream=True), CancelFlag(), lambda *f: frames.append(f))
    assert choices == []
    assert frames == [({"role": "assistant"}, None, None), ({"content": "x"}, None, None),
                      ({"content": " y"}, None, None), ({"content": " x"}, None, None), (None, None, "length")]
    assert usage.completion_tokens == 3


def test_cancel_stops_the_stream():
    flag = CancelFlag()
    frames = []

    def emit(*f):
        frames.append(f)
        if len(frames) == 3:
            flag.set()

    _, usage = _engine().chat(_chat(max_tokens=100, stream=True), flag, emit)
    assert usage.completion_tokens == 2
    assert frames[-1] == (None, None, "stop")


def test_complete_defaults_to_16_tokens_and_echo_prepends_prompt():
    eng = _engine(reply="w")
    choices, usage = eng.complete(CompletionJob(request_id="r", model="echo", prompt="p q"), CancelFlag(), None)
    assert choices[0].text == "w" + " w" * 15 and usage.completion_tokens == 16 and usage.prompt_tokens == 2
    choices, _ = eng.complete(CompletionJob(request_id="r", model="echo", prompt="p ", echo=True,
                                            params=SamplingParams(max_tokens=1)), CancelFlag(), None)
    assert choices[0].text == "p w"
    frames = []
    eng.complete(CompletionJob(request_id="r", model="echo", prompt="p", params=SamplingParams(max_tokens=2), stream=True),
                 CancelFlag(), lambda *f: frames.append(f))
    assert frames == [(None, "w", None), (None, " w", None), (None, "", "length")]


def test_offered_only_when_named():
    assert "echo" not in available_families()
    assert engine_class("echo") is EchoEngine
    assert CONFIG.serves() == ["chat", "complete"]
    settings = load_settings(WorkerSettings, "worker", env={"CODERAI_WORKER_FAMILIES": "echo"})
    assert settings.families == ["echo"]


def test_has_everything_the_worker_asks_of_an_engine():
    eng = _engine()
    assert eng.stats() == {}
    eng.close()


def test_token_delay_paces_each_token_in_threads_side_by_side():
    eng = _engine(reply="w", token_delay_s=0.01)
    assert (eng.blocking, eng.max_concurrency) == (True, 8)
    assert (_engine().blocking, _engine().max_concurrency) == (False, 1)
    times: list[float] = []
    eng.chat(_chat(max_tokens=5, stream=True), CancelFlag(), lambda *_: times.append(time.monotonic()))
    assert len(times) == 7 and times[-1] - times[0] >= 0.05  # the role, 5 tokens 10 ms apart, the finish
