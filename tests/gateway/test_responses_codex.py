"""The Responses API as Codex CLI speaks it: namespace and custom tools flattened for the chat template and
restored in the output, hosted tools dropped (never a 400), its session ids as the affinity session, the
default output cap, and the streamed events of its tool calls, checked against the official SDK's types."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from coderai.contracts import ChatJob, Choice, Chunk, RequestId, RouteRequest, SamplingParams, Usage
from coderai.gateway.openai.responses import ResponsesController, _with_session
from coderai.gateway.openai.responses_stream import EventStream
from coderai.gateway.openai.responses_types import (
    assistant_message,
    dropped_tools,
    from_choice,
    parse_request,
    response_body,
    response_job,
)
from coderai.testing.codex import MCP, PATCH, SHELL, WEB_SEARCH

EVENTS = TypeAdapter(ResponseStreamEvent)
CODEX_TOOLS = [
    SHELL,
    PATCH,
    WEB_SEARCH,
    MCP,
    {"type": "web_search_preview"},
    {"type": "image_generation"},
]


def codex_body(**more: object) -> dict:
    """A request shaped like Codex 0.171's first turn."""
    return {
        "model": "m",
        "instructions": "You are Codex.",
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199-thread",
        "parallel_tool_calls": False,
        "reasoning": None,
        "tool_choice": "auto",
        "tools": CODEX_TOOLS,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
        ],
        **more,
    }


def test_codex_first_turn_is_a_chat_job_with_flat_tools_and_the_hosted_ones_dropped():
    job, _ = response_job(codex_body(), "r1")
    assert job.messages == [
        {"role": "system", "content": "You are Codex."},
        {"role": "system", "content": "sandbox"},
        {"role": "user", "content": "list files"},
    ]
    names = [t["function"]["name"] for t in job.tools]
    assert names == ["shell", "apply_patch", "mcp__files__read"]
    patch = job.tools[1]["function"]
    assert patch["parameters"] == {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
    assert "start: begin_patch" in patch["description"]
    assert job.tools[2]["function"]["parameters"] == MCP["tools"][0]["parameters"]
    assert job.params.max_tokens is None and job.stream
    assert dropped_tools(parse_request(codex_body())) == ["image_generation", "web_search", "web_search_preview"]


def test_namespace_and_custom_calls_are_restored_in_the_output_items():
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "mcp__files__read", "arguments": '{"path":"a"}'}},
        {
            "id": "c2",
            "type": "function",
            "function": {"name": "apply_patch", "arguments": json.dumps({"input": "*** Begin Patch"})},
        },
        {"id": "c3", "type": "function", "function": {"name": "shell", "arguments": '{"command":["ls"]}'}},
    ]
    req = parse_request(codex_body(stream=False))
    output = from_choice(
        Choice(message={"role": "assistant", "content": None, "tool_calls": calls}, finish_reason="tool_calls"), req
    )
    assert [(it["type"], it["name"], it.get("namespace")) for it in output] == [
        ("function_call", "read", "mcp__files"),
        ("custom_tool_call", "apply_patch", None),
        ("function_call", "shell", None),
    ]
    assert output[1]["input"] == "*** Begin Patch" and output[1]["call_id"] == "c2"
    r = Response.model_validate(
        response_body(
            "resp_1", 0, req, output, Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2), "completed"
        )
    )
    assert r.output[0].namespace == "mcp__files" and r.output[1].input == "*** Begin Patch"
    # a stored continuation gets the calls back as the template saw them
    assert [c["function"] for c in assistant_message(output)["tool_calls"]] == [c["function"] for c in calls]


def test_codex_history_comes_back_as_chat_messages():
    history = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
        {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},
        {"type": "function_call", "namespace": "mcp__files", "name": "read", "call_id": "c1", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "text"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "Done"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}},
    ]
    job, _ = response_job(codex_body(input=history), "r1")
    assert job.messages[1:] == [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "mcp__files__read", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "text"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "apply_patch", "arguments": json.dumps({"input": "*** Begin Patch"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "Done"},
    ]


def test_tool_choice_names_a_custom_or_namespaced_tool():
    job, _ = response_job(codex_body(tool_choice={"type": "custom", "name": "apply_patch"}), "r1")
    assert job.tool_choice == {"type": "function", "function": {"name": "apply_patch"}}
    job, _ = response_job(codex_body(tool_choice={"type": "function", "name": "read", "namespace": "mcp__files"}), "r1")
    assert job.tool_choice == {"type": "function", "function": {"name": "mcp__files__read"}}


def _events(raw: bytes) -> list[dict]:
    out = []
    for block in raw.decode().split("\n\n")[:-1]:
        head, data = block.split("\n")
        event = json.loads(data[6:])
        assert event["type"] == head[7:]
        EVENTS.validate_python(event)
        out.append(event)
    return out


def test_streamed_namespace_and_custom_calls_are_openais_events():
    s = EventStream("resp_1", 0, parse_request(codex_body()))
    raw = s.start()
    raw += s.chunk(
        Chunk(
            seq=0,
            delta={
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "mcp__files__read", "arguments": ""},
                    }
                ]
            },
        )
    )
    raw += s.chunk(Chunk(seq=1, delta={"tool_calls": [{"index": 0, "function": {"arguments": '{"path":"a"}'}}]}))
    raw += s.chunk(
        Chunk(
            seq=2,
            delta={
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "c2",
                        "type": "function",
                        "function": {"name": "apply_patch", "arguments": '{"input":'},
                    }
                ]
            },
        )
    )
    raw += s.chunk(
        Chunk(
            seq=3, delta={"tool_calls": [{"index": 1, "function": {"arguments": ' "P"}'}}]}, finish_reason="tool_calls"
        )
    )
    tail, body = s.end(Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3))
    events = _events(raw + tail)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2]["item"]["name"] == "read" and events[2]["item"]["namespace"] == "mcp__files"
    assert events[6]["item"]["type"] == "custom_tool_call" and events[7]["input"] == "P"
    assert [(it["type"], it["name"]) for it in body["output"]] == [
        ("function_call", "read"),
        ("custom_tool_call", "apply_patch"),
    ]
    assert events[-1]["response"]["usage"]["total_tokens"] == 3
    Response.model_validate(body)


def _route(session: str = "") -> RouteRequest:
    return RouteRequest(request_id=RequestId("r"), model="m", op="chat", session=session)


def test_the_session_an_agent_names_keys_the_affinity():
    req = parse_request(codex_body())
    by_header = _with_session(_route(), SimpleNamespace(headers={"session-id": "s1"}), req)
    by_thread = _with_session(_route(), SimpleNamespace(headers={"thread-id": "s1"}), req)
    by_key = _with_session(_route(), SimpleNamespace(headers={}), req)
    assert by_header.session and by_header.session == by_thread.session != by_key.session
    again = _with_session(_route(), SimpleNamespace(headers={}), parse_request(codex_body()))
    assert by_key.session == again.session  # the prompt_cache_key, the same every turn
    assert _with_session(_route("x-session"), SimpleNamespace(headers={"session-id": "s1"}), req).session == "x-session"
    plain = parse_request({"model": "m", "input": "x"})
    assert _with_session(_route(), SimpleNamespace(headers={}), plain).session == ""


def _capped(max_tokens: int | None, default: int, params: dict) -> int | None:
    async def find_model(_name: str, _op: str) -> object:
        return SimpleNamespace(params=params)

    me = SimpleNamespace(
        gw=SimpleNamespace(settings=SimpleNamespace(default_max_output_tokens=default), find_model=find_model)
    )
    job = ChatJob(
        request_id=RequestId("r"),
        model="m",
        messages=[{"role": "user", "content": "x"}],
        params=SamplingParams(max_tokens=max_tokens),
    )
    return asyncio.run(ResponsesController._capped(me, job)).params.max_tokens


def test_no_max_output_tokens_gets_the_default_cap_within_the_context():
    assert _capped(None, 4096, {"n_ctx": 32768}) == 4096
    assert _capped(None, 4096, {"n_ctx": 1024}) == 1024
    assert _capped(7, 4096, {"n_ctx": 1024}) == 7  # the request's own wins
    assert _capped(None, 0, {"n_ctx": 1024}) is None  # the setting off
    assert _capped(None, 4096, {}) is None  # an engine without a known context keeps its own default
