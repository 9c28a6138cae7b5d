"""The Responses API's translation to and from the chat op, and its streamed events, as pure functions."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from coderai.contracts import Choice, Chunk, Usage
from coderai.gateway.errors import ApiError
from coderai.gateway.openai.responses_record import with_ids
from coderai.gateway.openai.responses_stream import EventStream
from coderai.gateway.openai.responses_types import (
    assistant_message,
    from_choice,
    parse_request,
    response_body,
    response_job,
    to_messages,
)

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city",
    "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
EVENTS = TypeAdapter(ResponseStreamEvent)


def test_a_string_input_with_instructions_is_a_system_and_a_user_message():
    job, conversation = response_job(
        {
            "model": "m",
            "input": "hi",
            "instructions": "be brief",
            "max_output_tokens": 9,
            "temperature": 0,
            "top_p": 0.5,
            "reasoning": {"effort": "low"},
        },
        "r1",
    )
    assert job.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert conversation == [{"role": "user", "content": "hi"}]  # a continuation does not inherit instructions
    assert (job.params.max_tokens, job.params.temperature, job.params.top_p) == (9, 0, 0.5)
    assert job.options == {"reasoning_effort": "low"} and not job.stream


def test_items_become_chat_messages_and_a_prior_conversation_comes_first():
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    prior = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "ok"}]
    job, _ = response_job({"model": "m", "input": items}, "r1", prior)
    assert job.messages[:2] == prior
    assert job.messages[2:] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "ab"},
        {
            "role": "assistant",
            "content": "let me look",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


def test_an_image_part_is_kept_as_chat_image_url_and_a_remote_one_refused():
    png = "data:image/png;base64,iVBORw0KGgo="
    [m] = to_messages(
        [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "what"}, {"type": "input_image", "image_url": png}],
            }
        ]
    )
    assert m["content"] == [
        {"type": "text", "text": "what"},
        {"type": "image_url", "image_url": {"url": png, "detail": "auto"}},
    ]
    with pytest.raises(ApiError) as exc:
        to_messages([{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/a.png"}]}])
    assert exc.value.status == 400 and exc.value.code == "invalid_image_url"


def test_function_tools_tool_choice_and_text_format_take_chat_shapes():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    job, _ = response_job(
        {
            "model": "m",
            "input": "x",
            "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}},
        },
        "r1",
    )
    assert job.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather of a city",
                "parameters": TOOL["parameters"],
                "strict": True,
            },
        }
    ]
    assert job.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert job.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "num", "schema": schema, "strict": True},
    }
    job, _ = response_job(
        {"model": "m", "input": "x", "text": {"format": {"type": "text"}}, "tool_choice": "required"}, "r1"
    )
    assert job.response_format is None and job.tool_choice == "required"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
        ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function"}]}]}, "tools[0].tools[0].name"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"background": True, "store": False}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"input": [{"role": "assistant", "content": "only me"}]}, "input"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)
def test_what_is_refused_is_a_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as exc:
        response_job({"model": "m", "input": "x", **body}, "r1")
    assert exc.value.status == 400 and exc.value.param == param


def test_a_tool_is_echoed_less_fields_of_a_type_openai_does_not_allow():
    """Schemathesis sent `allowed_callers: -27179572` and got it back in a 200, which broke the response schema."""
    from coderai.gateway.openai.responses_types import echoed

    sent = [
        {"type": "custom", "name": "c", "allowed_callers": -27179572},
        {**TOOL, "allowed_callers": ["anyone"], "defer_loading": "yes", "description": 5},
        {**TOOL, "allowed_callers": ["direct"], "defer_loading": True},
    ]
    got = echoed(sent)
    assert got[0] == {"type": "custom", "name": "c"}
    assert "allowed_callers" not in got[1] and "defer_loading" not in got[1] and "description" not in got[1]
    assert got[2] == sent[2]  # a tool of the right types comes back as it was sent


def test_a_namespace_echoes_its_own_tools_cleaned_alike():
    """Schemathesis (its examples re-drawn when the test file was reformatted) sent a namespace whose tools had
    `allowed_callers: 1386`: the namespace's tools are cleaned as a top-level tool is."""
    from coderai.gateway.openai.responses_types import echoed

    inner = [{**TOOL, "allowed_callers": 1386}, {**TOOL, "name": "b", "allowed_callers": ["direct"]}]
    got = echoed([{"type": "namespace", "name": "crm", "description": "d", "tools": inner}])
    assert got[0]["tools"] == [TOOL, inner[1]]
    assert got[0]["name"] == "crm" and inner[0]["allowed_callers"] == 1386  # what was sent is not changed


def test_a_chat_answer_becomes_output_items_that_the_sdk_reads():
    message = {
        "role": "assistant",
        "content": "calling",
        "reasoning_content": "think",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
        ],
    }
    output = from_choice(Choice(message=message, finish_reason="tool_calls"))
    assert [it["type"] for it in output] == ["reasoning", "message", "function_call"]
    assert output[2]["call_id"] == "call_1" and output[2]["id"].startswith("fc_")
    req = parse_request({"model": "m", "input": "x", "tools": [TOOL]})
    body = response_body(
        "resp_1", 0, req, output, Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7), "completed"
    )
    r = Response.model_validate(body)
    assert r.output_text == "calling" and r.usage.total_tokens == 7 and r.tools[0].name == "get_weather"
    # what a continuation sends back: the text and the call, with its id
    assert assistant_message(output) == {
        "role": "assistant",
        "content": "calling",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
        ],
    }


def test_a_length_finish_is_an_incomplete_message():
    [item] = from_choice(Choice(message={"role": "assistant", "content": "abc"}, finish_reason="length"))
    assert item["status"] == "incomplete"


def _events(raw: bytes) -> list[dict]:
    out = []
    for block in raw.decode().split("\n\n")[:-1]:
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data[6:])
        assert event["type"] == head[7:]
        EVENTS.validate_python(event)  # the SDK's own type of that event
        out.append(event)
    return out


def test_streamed_deltas_are_openais_event_sequence():
    req = parse_request({"model": "m", "input": "x", "stream": True})
    s = EventStream("resp_1", 0, req)
    raw = s.start()
    raw += s.chunk(Chunk(seq=0, delta={"role": "assistant", "reasoning_content": "hm"}))
    raw += s.chunk(Chunk(seq=1, delta={"content": "He"}))
    raw += s.chunk(Chunk(seq=2, delta={"content": "llo"}))
    raw += s.chunk(
        Chunk(
            seq=3,
            delta={
                "tool_calls": [
                    {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
                ]
            },
        )
    )
    raw += s.chunk(
        Chunk(seq=4, delta={"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, finish_reason="tool_calls")
    )
    tail, body = s.end(Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3))
    events = _events(raw + tail)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [it["type"] for it in body["output"]] == ["reasoning", "message", "function_call"]
    assert body["output"][1]["content"][0]["text"] == "Hello" and body["output"][2]["arguments"] == "{}"
    assert events[-1]["response"] == body and body["status"] == "completed"


def test_an_empty_answer_still_has_a_message_and_a_failure_is_an_error_event():
    s = EventStream("resp_1", 0, parse_request({"model": "m", "input": "x"}))
    tail, body = s.end(Usage())
    assert [e["type"] for e in _events(tail)][-1] == "response.completed" and body["output"][0]["type"] == "message"
    s = EventStream("resp_2", 0, parse_request({"model": "m", "input": "x"}))
    s.chunk(Chunk(seq=0, delta={"content": "a"}))
    raw, body = s.fail(ApiError(502, "engine died", code="engine_failed"))
    assert [e["type"] for e in _events(raw)] == ["error", "response.failed"] and body["status"] == "failed"


def test_input_items_get_ids_and_typed_content():
    [a, b] = with_ids(
        [
            {"role": "user", "content": "hi"},
            {"type": "function_call_output", "call_id": "c", "output": "x", "id": "fco_given"},
        ]
    )
    assert (
        a["id"].startswith("msg_") and a["type"] == "message" and a["content"] == [{"type": "input_text", "text": "hi"}]
    )
    assert b["id"] == "fco_given"


def test_no_node_may_read_the_stored_responses():
    from coderai.contracts.topology import RESPONSES
    from coderai.runtime.members import node_permissions

    rights = json.dumps(node_permissions("n1", ["work-tiny-chat"]))
    assert RESPONSES.name not in rights and "$KV.>" not in rights and "KV_*" not in rights
