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
    return ChatJob(
        request_id="r",
        model="echo",
        messages=[{"role": "user", "content": "two words"}],
        params=SamplingParams(max_tokens=max_tokens, n=n),
        stream=stream,
    )


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
    choices, usage = _engine(reply="x y").chat(
        _chat(max_tokens=3, stream=True), CancelFlag(), lambda *f: frames.append(f)
    )
    assert choices == []
    assert frames == [
        ({"role": "assistant"}, None, None),
        ({"content": "x"}, None, None),
        ({"content": " y"}, None, None),
        ({"content": " x"}, None, None),
        (None, None, "length"),
    ]
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


def test_cancel_ends_a_paced_whole_answer_at_the_next_token():
    """A paced whole answer (no stream) stops at its cancel as a model's does: one whose client left while it was
    queued used to sleep out all its tokens (2000 at 50 ms: the worker's stop waited out its drain for it)."""
    eng = _engine(reply="w", token_delay_s=0.001)
    flag, paced = CancelFlag(), []
    pace = eng._pace

    def one_token(tokens: int = 1) -> None:  # the client leaves after the third token
        pace(tokens)
        paced.append(tokens)
        if len(paced) == 3:
            flag.set()

    eng._pace = one_token
    choices, usage = eng.chat(_chat(max_tokens=100_000), flag, None)  # 100 s uncancelled
    assert paced == [1, 1, 1] and usage.completion_tokens == 3
    assert choices[0].finish_reason == "stop" and choices[0].message["content"] == "w w w"


def test_complete_defaults_to_16_tokens_and_echo_prepends_prompt():
    eng = _engine(reply="w")
    choices, usage = eng.complete(CompletionJob(request_id="r", model="echo", prompt="p q"), CancelFlag(), None)
    assert choices[0].text == "w" + " w" * 15 and usage.completion_tokens == 16 and usage.prompt_tokens == 2
    choices, _ = eng.complete(
        CompletionJob(request_id="r", model="echo", prompt="p ", echo=True, params=SamplingParams(max_tokens=1)),
        CancelFlag(),
        None,
    )
    assert choices[0].text == "p w"
    frames = []
    eng.complete(
        CompletionJob(request_id="r", model="echo", prompt="p", params=SamplingParams(max_tokens=2), stream=True),
        CancelFlag(),
        lambda *f: frames.append(f),
    )
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


SCRIPT = {"Read": {"file_path": "/tmp/x"}, "shell": {"command": ["cat", "x"]}}
READ = {"type": "function", "function": {"name": "Read", "parameters": {"type": "object"}}}


def _turn(messages, tools=(READ,), stream=False, max_tokens=None, tool_choice=None) -> ChatJob:
    return ChatJob(
        request_id="req-0123456789abcdef",
        model="echo",
        messages=messages,
        tools=list(tools) or None,
        tool_choice=tool_choice,
        params=SamplingParams(max_tokens=max_tokens),
        stream=stream,
    )


def test_a_scripted_engine_calls_the_first_offered_tool_it_names():
    eng = _engine(reply="Done:", tool_calls=SCRIPT)
    choices, _ = eng.chat(_turn([{"role": "user", "content": "read it"}], max_tokens=32000), CancelFlag(), None)
    call = choices[0].message["tool_calls"][0]
    assert choices[0].finish_reason == "tool_calls" and call["function"]["name"] == "Read"
    assert call["function"]["arguments"] == '{"file_path": "/tmp/x"}' and call["id"].startswith("call_")
    frames = []
    eng.chat(_turn([{"role": "user", "content": "read it"}], stream=True), CancelFlag(), lambda *f: frames.append(f))
    assert frames[1][0]["tool_calls"][0]["function"]["name"] == "Read" and frames[-1] == (None, None, "tool_calls")


def test_a_scripted_engine_answers_a_tool_result_with_its_text_and_stops_before_max_tokens():
    eng = _engine(reply="Done:", tool_calls=SCRIPT)
    msgs = [
        {"role": "user", "content": "read it"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "Read", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "secret 42"}]},
    ]
    choices, usage = eng.chat(_turn(msgs, max_tokens=32000), CancelFlag(), None)
    assert choices[0].message["content"] == "Done: secret 42" and choices[0].finish_reason == "stop"
    choices, _ = eng.chat(_turn(msgs, max_tokens=2), CancelFlag(), None)
    assert choices[0].message["content"] == "Done: secret" and choices[0].finish_reason == "length"


def test_a_scripted_engine_without_its_tools_offered_just_replies():
    eng = _engine(reply="plain answer", tool_calls=SCRIPT)
    for job in (
        _turn([{"role": "user", "content": "hi"}], tools=()),
        _turn([{"role": "user", "content": "hi"}], tool_choice="none"),
    ):
        choices, _ = eng.chat(job, CancelFlag(), None)
        assert choices[0].message == {"role": "assistant", "content": "plain answer"}


def test_a_reminder_beside_a_tool_result_does_not_begin_a_new_turn():
    eng = _engine(reply="Done:", tool_calls=SCRIPT)
    call = {"id": "c", "type": "function", "function": {"name": "Read", "arguments": "{}"}}
    msgs = [
        {"role": "user", "content": "read it"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "secret 42"},
        {"role": "user", "content": "<system-reminder>be brief</system-reminder>"},
    ]
    choices, _ = eng.chat(_turn(msgs), CancelFlag(), None)
    assert choices[0].message["content"] == "Done: secret 42"
    choices, _ = eng.chat(
        _turn(msgs + [{"role": "assistant", "content": "Done: secret 42"}, {"role": "user", "content": "again"}]),
        CancelFlag(),
        None,
    )
    assert choices[0].finish_reason == "tool_calls"
