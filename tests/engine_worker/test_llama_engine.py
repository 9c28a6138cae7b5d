"""The llama.cpp engine on a tiny GGUF built by the test session: real generation, on the CPU."""

from __future__ import annotations

import json
import threading

import pytest

from coderai.contracts import ChatJob, CompletionJob, ModelConfig, SamplingParams
from coderai.engine_worker.engines import EngineLoadError, available_families, engine_class
from coderai.engine_worker.engines.base import CancelFlag
from coderai.testing import jobs as testing_jobs

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    e = engine_class("llama")(
        ModelConfig(name="t", engine="llama", path=str(tiny_gguf), params={"n_ctx": 1024, "seed": 7})
    )
    e.load()
    yield e
    e.close()


def chat(content: str = "hi", **kw) -> ChatJob:
    return testing_jobs.chat(content, model="t", **kw)


def test_llama_is_an_available_family():
    assert "llama" in available_families()


def test_chat_answers_with_usage(engine):
    choices, usage = engine.chat(chat(), CancelFlag(), None)
    assert len(choices) == 1 and choices[0].message["role"] == "assistant"
    assert isinstance(choices[0].message["content"], str)
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_greedy_stream_matches_greedy_whole(engine):
    whole, _ = engine.chat(chat(params={"max_tokens": 12}), CancelFlag(), None)
    pieces: list[tuple] = []
    _, usage = engine.chat(
        chat(stream=True, params={"max_tokens": 12}), CancelFlag(), lambda d, t, f: pieces.append((d, f))
    )
    text = "".join((d or {}).get("content", "") for d, _ in pieces)
    assert text == whole[0].message["content"]
    assert pieces[0][0] == {"role": "assistant"}
    assert pieces[-1][1] in ("stop", "length")
    assert usage.completion_tokens > 0


def test_n_choices(engine):
    choices, usage = engine.chat(chat(params={"n": 3, "temperature": 1.0}), CancelFlag(), None)
    assert [c.index for c in choices] == [0, 1, 2]
    assert usage.prompt_tokens > 0


def test_completion_respects_max_tokens(engine):
    choices, usage = engine.complete(
        CompletionJob(request_id="r", model="t", prompt="def f():", params=SamplingParams(max_tokens=5, temperature=0)),
        CancelFlag(),
        None,
    )
    assert usage.completion_tokens <= 5 and choices[0].text is not None


def test_json_schema_response_format_is_enforced(engine):
    rf = {
        "type": "json_schema",
        "json_schema": {
            "name": "x",
            "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        },
    }
    choices, _ = engine.chat(chat(response_format=rf, params={"max_tokens": 40}), CancelFlag(), None)
    doc = json.loads(choices[0].message["content"])
    assert isinstance(doc["a"], int)


def test_forced_tool_choice_returns_a_tool_call(engine):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                    "required": ["city"],
                },
            },
        }
    ]
    job = chat(
        tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}, params={"max_tokens": 40}
    )
    choices, _ = engine.chat(job, CancelFlag(), None)
    call = choices[0].message["tool_calls"][0]
    assert choices[0].finish_reason == "tool_calls"
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])


def test_cancel_stops_generation_early(engine):
    flag = CancelFlag()
    seen = []

    def emit(d, t, f):
        seen.append(d)
        if len(seen) == 3:
            flag.set()

    _, usage = engine.complete(
        CompletionJob(
            request_id="r", model="t", prompt="x", stream=True, params=SamplingParams(max_tokens=500, temperature=0)
        ),
        flag,
        emit,
    )
    assert len(seen) == 3  # nothing emitted after the flag
    assert usage.completion_tokens < 10  # and llama.cpp stopped decoding, not at max_tokens


def test_cancel_ends_a_whole_answer_at_the_next_token(engine):
    flag = CancelFlag()
    flag.set()  # the caller left before the engine got to this job
    job = CompletionJob(request_id="r", model="t", prompt="x", params=SamplingParams(max_tokens=500, temperature=0))
    choices, usage = engine.complete(job, flag, None)
    assert usage.completion_tokens <= 1 and choices[0].finish_reason == "stop"


def test_prompt_longer_than_context_is_a_value_error(engine):
    with pytest.raises(ValueError, match="context window"):
        engine.complete(
            CompletionJob(request_id="r", model="t", prompt="word " * 3000, params=SamplingParams(max_tokens=5)),
            CancelFlag(),
            None,
        )


def test_engine_runs_one_job_at_a_time_safely(engine):
    # the worker serializes jobs on one thread; this checks the engine stays sane across threads used in turn
    results = []
    lock = threading.Lock()

    def run():
        with lock:
            results.append(engine.chat(chat(), CancelFlag(), None)[1].completion_tokens)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r > 0 for r in results)


def test_missing_file_is_a_load_error(tmp_path):
    e = engine_class("llama")(ModelConfig(name="x", engine="llama", path=str(tmp_path / "nope.gguf")))
    with pytest.raises(EngineLoadError, match="not found"):
        e.load()


def test_garbage_file_is_a_load_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(EngineLoadError):
        engine_class("llama")(ModelConfig(name="x", engine="llama", path=str(bad))).load()


def test_unknown_family_is_a_load_error():
    with pytest.raises(EngineLoadError, match="no engine family"):
        engine_class("nonsense")


def test_prompt_cache_keeps_interleaved_conversations_warm(tiny_gguf):
    """Two conversations taking turns on one engine: each turn after the first reuses its own prefix."""
    e = engine_class("llama")(
        ModelConfig(name="c", engine="llama", path=str(tiny_gguf), params={"n_ctx": 1024, "prompt_cache_mb": 64})
    )
    e.load()
    try:
        convs = {name: [{"role": "system", "content": f"{name} " * 150}] for name in ("alpha", "beta")}
        for turn in range(3):
            for name, msgs in convs.items():
                msgs.append({"role": "user", "content": f"turn {turn}"})
                choices, _ = e.chat(
                    ChatJob(
                        request_id="r", model="c", messages=msgs, params=SamplingParams(max_tokens=3, temperature=0)
                    ),
                    CancelFlag(),
                    None,
                )
                msgs.append({"role": "assistant", "content": choices[0].message.get("content") or "ok"})
        s = e.stats()
        assert s["prefix_hits"] >= 4  # every turn after each conversation's first
        assert s["cached_tokens"] > s["prompt_tokens"] / 2  # most prompt tokens came from the cache
        assert s["cache_bytes"] > 0
    finally:
        e.close()


def test_prompt_cache_can_be_turned_off(tiny_gguf):
    e = engine_class("llama")(
        ModelConfig(name="c", engine="llama", path=str(tiny_gguf), params={"n_ctx": 512, "prompt_cache_mb": 0})
    )
    e.load()
    try:
        e.chat(chat(), CancelFlag(), None)
        assert e.stats()["cache_bytes"] == 0
    finally:
        e.close()


def test_streamed_tool_call_deltas_name_the_call_once():
    from coderai.engine_worker.engines.llama import openai_delta

    def chunk(args: str) -> dict:  # what llama-cpp-python streams for one tool call: everything, every time
        return {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": args},
            "tool_calls": [
                {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
            ],
        }

    announced: set[int] = set()
    deltas = [openai_delta(chunk(a), announced) for a in ('{"city"', ': "Paris"', "}")]
    assert all("function_call" not in d for d in deltas)
    first, *rest = [d["tool_calls"][0] for d in deltas]
    assert first == {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city"'},
    }
    assert rest == [{"index": 0, "function": {"arguments": ': "Paris"'}}, {"index": 0, "function": {"arguments": "}"}}]
