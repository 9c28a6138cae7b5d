"""A server's stream over several choices, put back together: the whole choices an n > 1 (or prompt-list) answer
is made of, and its usage counted once per prompt."""

from __future__ import annotations

from coderai.contracts import ChatJob, ModelConfig, SamplingParams
from coderai.engine_worker.engines.base import Engine, unhonoured
from coderai.engine_worker.engines.openai_wire import Assembly, merged_usage


def test_chat_pieces_become_whole_messages_tool_calls_included():
    a = Assembly(chat=True)
    a.add({"content": "Hel"}, None, None)
    a.add({"content": "Hi"}, None, None, index=1)
    a.add({"content": "lo", "reasoning_content": "hm"}, None, "stop")
    a.add(
        {
            "tool_calls": [
                {"index": 0, "id": "c1", "type": "function", "function": {"name": "get_", "arguments": '{"ci'}}
            ]
        },
        None,
        None,
        index=1,
    )
    a.add(
        {"tool_calls": [{"index": 0, "function": {"name": "weather", "arguments": 'ty": 1}'}}]},
        None,
        "tool_calls",
        logprobs={"content": [{"token": "x"}]},
        index=1,
    )
    first, second = a.choices()
    assert first.message == {"role": "assistant", "content": "Hello", "reasoning_content": "hm"}
    assert first.finish_reason == "stop" and first.logprobs is None
    assert second.index == 1 and second.finish_reason == "tool_calls" and second.message["content"] == "Hi"
    assert second.message["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": 1}'}}
    ]
    assert second.logprobs == {"content": [{"token": "x"}]}


def test_completion_pieces_and_their_logprobs_join():
    a = Assembly(chat=False)
    a.add(None, "ab", None, logprobs={"tokens": ["a", "b"], "token_logprobs": [-1, -2]})
    a.add(None, "c", "length", logprobs={"tokens": ["c"], "token_logprobs": [-3]})
    (only,) = a.choices()
    assert (only.text, only.finish_reason) == ("abc", "length")
    assert only.logprobs == {"tokens": ["a", "b", "c"], "token_logprobs": [-1, -2, -3]}


def test_usage_counts_every_completion_token_and_each_prompt_once():
    per_choice = [{"prompt_tokens": 14, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 10}}] * 2
    assert merged_usage(per_choice, 2) == {
        "prompt_tokens": 14,
        "completion_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 10},
    }
    prompts = [{"prompt_tokens": 2, "completion_tokens": 3}, {"prompt_tokens": 5, "completion_tokens": 1}]
    assert merged_usage(prompts, 1)["prompt_tokens"] == 7 and merged_usage(prompts, 1)["completion_tokens"] == 4
    assert merged_usage(prompts[:1], 1) is prompts[0]


def test_an_engine_refuses_what_it_cannot_honour_by_name():
    engine = Engine(ModelConfig(name="m", engine="x", path="p"))
    job = ChatJob(request_id="r", model="m", messages=[], params=SamplingParams(n=2), stream=True)
    refused = unhonoured(engine, job)
    assert refused is not None and refused.param == "n" and "streams one choice" in str(refused)
    engine.streams_choices = True
    assert unhonoured(engine, job) is None
    biased = ChatJob(request_id="r", model="m", messages=[], params=SamplingParams(logit_bias={"1": 2.0}))
    assert unhonoured(engine, biased).param == "logit_bias"


def test_a_conversation_llama_server_cannot_parse_is_the_clients_mistake():
    import pytest

    from coderai.engine_worker.engines.openai_wire import raise_error
    from coderai.engine_worker.engines.base import BadInput

    with pytest.raises(BadInput) as bad:  # llama-server says 500, but the messages were the client's
        raise_error({"error": {"code": 500, "message": "Failed to parse messages: Unsupported tool call type"}}, 500)
    assert bad.value.param == "messages"
    with pytest.raises(RuntimeError):  # a real failure stays one
        raise_error({"error": {"code": 500, "message": "out of memory"}}, 500)
