"""OpenAI request bodies at the edge: 400s that name the field, and the translation into internal jobs."""

from __future__ import annotations

import json

import pytest

from coderai.contracts import ChatJob, CompletionJob, SamplingParams
from coderai.gateway.errors import ApiError
from coderai.gateway.http import parse
from coderai.gateway.openai.chat_types import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_job,
    completion_job,
    include_usage,
)

USER = {"role": "user", "content": "hi"}


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def chat(**fields) -> ChatCompletionRequest:
    fields.setdefault("model", "m")
    fields.setdefault("messages", [USER])
    return parse(body(**fields), ChatCompletionRequest)


def completion(**fields) -> CompletionRequest:
    fields.setdefault("model", "m")
    fields.setdefault("prompt", "def f(")
    return parse(body(**fields), CompletionRequest)


def api_error(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as ei:
        fn(*args)
    return ei.value


@pytest.mark.parametrize("raw", [b"", b"{", b"not json", b'{"model": "m",}', b"\xff\xfe"])
def test_malformed_or_empty_body_is_invalid_json(raw):
    for type_ in (ChatCompletionRequest, CompletionRequest):
        err = api_error(parse, raw, type_)
        assert (err.status, err.code, err.type, err.param) == (400, "invalid_json", "invalid_request_error", None)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"model": "m"}, "messages"),
        ({"messages": [USER]}, "model"),
        ({"model": "", "messages": [USER]}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": ["hi"]}, "messages[0]"),
        ({"model": "m", "messages": [USER], "temperature": 2.5}, "temperature"),
        ({"model": "m", "messages": [USER], "temperature": -0.1}, "temperature"),
        ({"model": "m", "messages": [USER], "temperature": "hot"}, "temperature"),
        ({"model": "m", "messages": [USER], "n": 0}, "n"),
        ({"model": "m", "messages": [USER], "n": 17}, "n"),
        ({"model": "m", "messages": [USER], "n": 1.5}, "n"),
        ({"model": "m", "messages": [USER], "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": [USER], "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"model": "m", "messages": [USER], "top_p": 1.1}, "top_p"),
        ({"model": "m", "messages": [USER], "presence_penalty": 3}, "presence_penalty"),
        ({"model": "m", "messages": [USER], "frequency_penalty": -2.5}, "frequency_penalty"),
        ({"model": "m", "messages": [USER], "stream": "yes"}, "stream"),
        ({"model": "m", "messages": [USER], "stop": 5}, "stop"),
        ({"model": "m", "messages": [USER], "stop": ["a", 1]}, "stop[1]"),
        ({"model": "m", "messages": [USER], "stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
    ],
)
def test_chat_schema_errors_name_the_field(fields, param):
    err = api_error(parse, body(**fields), ChatCompletionRequest)
    assert (err.status, err.code, err.param) == (400, "invalid_request", param)
    assert err.message.startswith("Invalid request: ")


def test_a_json_value_that_is_not_an_object_is_invalid_request_without_a_param():
    err = api_error(parse, b"[]", ChatCompletionRequest)
    assert (err.status, err.code, err.param) == (400, "invalid_request", None)


def test_temperature_bounds_are_inclusive():
    assert chat(temperature=0).temperature == 0
    assert chat(temperature=2).temperature == 2


def test_unknown_top_level_fields_are_accepted():
    req = chat(some_future_field={"x": 1}, metadata={"a": "b"}, store=True)
    assert req.model == "m" and req.messages == [USER]
    assert completion(best_of=2).prompt == "def f("


def test_completion_schema_errors_name_the_field():
    err = api_error(parse, body(model="m"), CompletionRequest)
    assert (err.code, err.param) == ("invalid_request", "prompt")
    err = api_error(parse, body(model="m", prompt=3), CompletionRequest)
    assert (err.code, err.param) == ("invalid_request", "prompt")


def test_chat_job_carries_the_request_through():
    req = chat(
        model="qwen",
        temperature=0.2,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        n=2,
        stop="\n",
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice="auto",
        response_format={"type": "json_object"},
    )
    job = chat_job(req, "req-1")
    assert isinstance(job, ChatJob)
    assert job.request_id == "req-1" and job.model == "qwen" and job.messages == [USER] and job.stream is False
    assert job.params == SamplingParams(
        temperature=0.2, top_p=0.9, stop=["\n"], seed=7, presence_penalty=0.5, frequency_penalty=-0.5, n=2
    )
    assert job.tools == [{"type": "function", "function": {"name": "f"}}]
    assert job.tool_choice == "auto"
    assert job.response_format == {"type": "json_object"}


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat_job(chat(max_tokens=10, max_completion_tokens=20), "r").params.max_tokens == 20
    assert chat_job(chat(max_tokens=10), "r").params.max_tokens == 10
    assert chat_job(chat(max_completion_tokens=5), "r").params.max_tokens == 5
    assert chat_job(chat(), "r").params.max_tokens is None


def test_stop_string_becomes_a_list_and_none_becomes_empty():
    assert chat_job(chat(stop="END"), "r").params.stop == ["END"]
    assert chat_job(chat(stop=["a", "b"]), "r").params.stop == ["a", "b"]
    assert chat_job(chat(), "r").params.stop == []
    assert chat_job(chat(stop=None), "r").params.stop == []


def test_four_stops_are_fine_five_are_a_400():
    assert chat_job(chat(stop=list("abcd")), "r").params.stop == list("abcd")
    err = api_error(chat_job, chat(stop=list("abcde")), "r")
    assert (err.status, err.code, err.param) == (400, "invalid_request", "stop")
    err = api_error(completion_job, completion(stop=list("abcde")), "r")
    assert (err.status, err.param) == (400, "stop")


@pytest.mark.parametrize("role", [None, "robot", "USER", ""])
def test_an_unknown_role_is_a_400_naming_the_message(role):
    msgs = [USER, {"role": role, "content": "x"} if role is not None else {"content": "x"}]
    err = api_error(chat_job, chat(messages=msgs), "r")
    assert (err.status, err.code, err.param) == (400, "invalid_request", "messages[1].role")


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool", "function"])
def test_every_openai_role_is_accepted(role):
    assert chat_job(chat(messages=[{"role": role, "content": "x"}]), "r").messages == [{"role": role, "content": "x"}]


def test_an_unhashable_role_is_a_400():
    err = api_error(chat_job, chat(messages=[{"role": ["user"], "content": "x"}]), "r")
    assert (err.status, err.param) == (400, "messages[0].role")


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    "calls, param, code",
    [
        (
            [{"id": "c1", "type": "custom", "custom": {"name": "f", "input": "x"}}],
            "messages[0].tool_calls[0]",
            "unsupported_tool_call",
        ),
        ([CALL, "f"], "messages[0].tool_calls[1]", "unsupported_tool_call"),
        ([{"id": "c1", "type": "function"}], "messages[0].tool_calls[0].function", "invalid_request"),
        (
            [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}],
            "messages[0].tool_calls[0].function",
            "invalid_request",
        ),
        ({"id": "c1"}, "messages[0].tool_calls", "invalid_request"),
    ],
)
def test_an_earlier_tool_call_that_is_not_a_function_call_is_a_400(calls, param, code):
    err = api_error(chat_job, chat(messages=[{"role": "assistant", "content": None, "tool_calls": calls}]), "r")
    assert (err.status, err.param, err.code) == (400, param, code)


def test_an_earlier_function_call_passes_as_it_came():
    msg = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    assert (
        chat_job(chat(messages=[msg, {"role": "tool", "tool_call_id": "c1", "content": "1"}]), "r").messages[0] == msg
    )


def test_text_parts_are_flattened_to_a_string_and_other_keys_kept():
    msg = {
        "role": "user",
        "name": "bob",
        "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}],
    }
    job = chat_job(chat(messages=[msg]), "r")
    assert job.messages == [{"role": "user", "name": "bob", "content": "Hello, world"}]


def test_parts_with_an_image_are_kept_as_a_list():
    parts = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
    ]
    job = chat_job(chat(messages=[{"role": "user", "content": parts}]), "r")
    assert job.messages == [{"role": "user", "content": parts}]


@pytest.mark.parametrize("content", [3, {"type": "text", "text": "x"}, True])
def test_content_of_the_wrong_type_is_a_400(content):
    err = api_error(chat_job, chat(messages=[{"role": "user", "content": content}]), "r")
    assert (err.status, err.param) == (400, "messages[0].content")


@pytest.mark.parametrize("role", ["system", "user", "tool"])
def test_content_none_is_a_400_unless_assistant(role):
    for msg in ({"role": role, "content": None}, {"role": role}):
        err = api_error(chat_job, chat(messages=[msg]), "r")
        assert (err.status, err.code, err.param) == (400, "invalid_request", "messages[0].content")


def test_assistant_may_omit_content_for_tool_calls():
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    msgs = [USER, call, {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert chat_job(chat(messages=msgs), "r").messages == msgs


def test_n_over_one_is_carried_streamed_or_not():
    # the engine answers n > 1 streamed where it can (llama-server, vLLM) and refuses it with a 400 where not
    assert chat_job(chat(stream=True, n=2), "r").params.n == 2
    assert chat_job(chat(stream=False, n=3), "r").params.n == 3
    assert completion_job(completion(stream=True, n=2), "r").params.n == 2


def test_logit_bias_takes_token_ids_and_biases_in_range():
    assert chat_job(chat(logit_bias={"42": -100, "7": 5.5}), "r").params.logit_bias == {"42": -100, "7": 5.5}
    assert completion_job(completion(logit_bias={"3": 1}), "r").params.logit_bias == {"3": 1}
    assert chat_job(chat(logit_bias={}), "r").params.logit_bias is None
    err = api_error(chat_job, chat(logit_bias={"hello": 1}), "r")
    assert (err.status, err.param) == (400, "logit_bias")
    err = api_error(parse, body(model="m", messages=[USER], logit_bias={"1": 101}), ChatCompletionRequest)
    assert (err.status, err.code) == (400, "invalid_request") and "logit_bias" in (err.param or err.message)


def test_response_format_text_is_dropped_and_json_kinds_kept():
    assert chat_job(chat(response_format={"type": "text"}), "r").response_format is None
    assert chat_job(chat(), "r").response_format is None
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert chat_job(chat(response_format=schema), "r").response_format == schema


@pytest.mark.parametrize("rf", [{"type": "xml"}, {}, {"type": None}])
def test_a_bad_response_format_type_is_a_400(rf):
    err = api_error(chat_job, chat(response_format=rf), "r")
    assert (err.status, err.code, err.param) == (400, "invalid_request", "response_format")


def test_empty_tools_become_none():
    assert chat_job(chat(tools=[]), "r").tools is None


def test_completion_job_carries_the_request_through():
    job = completion_job(completion(prompt="abc", echo=True, max_tokens=3, temperature=1.5, stop="x", seed=1), "c-1")
    assert isinstance(job, CompletionJob)
    assert (job.request_id, job.model, job.prompt, job.echo, job.stream) == ("c-1", "m", "abc", True, False)
    assert job.params == SamplingParams(max_tokens=3, temperature=1.5, stop=["x"], seed=1)


def test_a_list_prompt_is_kept_a_list_of_one_unwrapped_an_empty_one_a_400():
    assert completion_job(completion(prompt=["only"]), "r").prompt == "only"
    assert completion_job(completion(prompt=["a", "b"]), "r").prompt == ["a", "b"]
    for prompt, n in (([], 1), (["p"] * 65, 2)):
        err = api_error(completion_job, completion(prompt=prompt, n=n), "r")
        assert (err.status, err.code, err.param) == (400, "invalid_request", "prompt")


def test_include_usage_follows_stream_options():
    assert include_usage(chat()) is False
    assert include_usage(chat(stream_options={})) is False
    assert include_usage(chat(stream=True, stream_options={"include_usage": True})) is True
    assert include_usage(completion(stream_options={"include_usage": True})) is True


def test_logprobs_and_engine_options_are_carried_to_the_job():
    job = chat_job(
        chat(logprobs=True, top_logprobs=3, reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}),
        "r",
    )
    assert job.params.logprobs is True and job.params.top_logprobs == 3
    assert job.options == {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}
    assert chat_job(chat(), "r").options is None and chat_job(chat(), "r").params.logprobs is False
    done = completion_job(completion(logprobs=2), "r")
    assert done.params.logprobs is True and done.params.top_logprobs == 2


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_top_logprobs_out_of_range_or_alone_is_a_400(fields, param):
    err = api_error(chat_job, chat(**fields), "r")
    assert err.status == 400 and err.param == param


@pytest.mark.parametrize(
    "url", ["http://169.254.169.254/latest/meta-data", "https://example.com/cat.png", "file:///etc/passwd"]
)
def test_a_remote_image_url_is_refused_and_a_data_url_passes(url):
    parts = [{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": url}}]
    err = api_error(chat_job, chat(messages=[{"role": "user", "content": parts}]), "r")
    assert err.status == 400 and err.param == "messages[0].content[1].image_url"
    ok = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    assert chat_job(chat(messages=[{"role": "user", "content": ok}]), "r").messages[0]["content"] == ok
