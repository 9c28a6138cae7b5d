"""OpenAI's Responses API against a real stack, driven by the official `openai` SDK and the OpenAI Agents SDK: the
overfitted tool model (coderai.testing.tool_gguf) behind llama-server, which calls `get_weather` when asked about
the weather and answers REPLY to anything else, behind a keys file with two keys."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.testing.codex import MCP, PATCH, SHELL, WEB_SEARCH
from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow
KEY, OTHER = "sk-responses-alice-0123456789", "sk-responses-bob-0123456789"
MODEL = "tools"
WEATHER = "what is the weather in Paris"
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tool_gguf):
    from coderai.engine_worker.engines.llama_server import find_binary

    if find_binary() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    keys = tmp_path_factory.mktemp("responses-keys") / "keys.toml"
    write_keys(
        str(keys), [KeyRecord("alice", hash_key(KEY), ["inference"]), KeyRecord("bob", hash_key(OTHER), ["inference"])]
    )
    models = [
        {
            "name": MODEL,
            "engine": "llama-server",
            "path": str(tool_gguf),
            "params": {"parallel": 2, "n_ctx": 1024, "n_threads": 2},
        }
    ]
    auth = {"Authorization": f"Bearer {KEY}"}
    with running_stack(
        tmp_path_factory.mktemp("responses"), models, gateway_args=("--api-keys-file", str(keys)), headers=auth
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def other(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=OTHER, max_retries=0, timeout=120)


def test_a_text_answer_whole_and_streamed_agree(client):
    whole = client.responses.create(model=MODEL, input="hello there", temperature=0, store=False)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.status == "completed"
    assert whole.output_text == "Hello! How can I help?"
    [msg] = whole.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    u = whole.usage
    assert u.input_tokens > 0 and u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    events = list(client.responses.create(model=MODEL, input="hello there", temperature=0, store=False, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text and events[-1].response.usage.output_tokens > 0


def test_the_sdk_stream_helper_accumulates_the_answer(client):
    with client.responses.stream(model=MODEL, input="hello there", temperature=0, store=False) as stream:
        final = stream.get_final_response()
    assert final.output_text == "Hello! How can I help?" and final.status == "completed"


def test_max_output_tokens_makes_an_incomplete_response(client):
    r = client.responses.create(model=MODEL, input="hello there", temperature=0, max_output_tokens=2, store=False)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2


def test_a_function_tool_round_trip_continues_on_the_same_engine(client):
    first = client.responses.with_raw_response.create(model=MODEL, input=WEATHER, tools=[TOOL], temperature=0)
    r1 = first.parse()
    [call] = [it for it in r1.output if it.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.id.startswith("fc_") and call.call_id
    second = client.responses.with_raw_response.create(
        model=MODEL,
        previous_response_id=r1.id,
        tools=[TOOL],
        temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"sky": "sunny"})}],
    )
    r2 = second.parse()
    assert r2.status in ("completed", "incomplete") and r2.previous_response_id == r1.id and r2.output
    # the continuation extends the first turn's affinity chain: the router sends it where that turn ran
    assert second.headers["coderai-route"] == "prefix"
    assert second.headers["coderai-engine"] == first.headers["coderai-engine"]
    items = client.responses.input_items.list(r2.id, order="asc")
    assert [it.type for it in items.data] == ["function_call_output"] and items.data[0].call_id == call.call_id


def test_a_streamed_function_call(client):
    events = list(
        client.responses.create(model=MODEL, input=WEATHER, tools=[TOOL], temperature=0, stream=True, store=False)
    )
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert len(added) == 1 and added[0].item.name == "get_weather"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(args) == json.loads(done.arguments) == {"city": "Paris"}
    assert events[-1].type == "response.completed"
    assert [it.type for it in events[-1].response.output] == ["function_call"]


def test_retrieve_input_items_and_delete(client, other):
    r = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "hello"}],
        temperature=0,
        instructions="You are a test model.",
        metadata={"run": "1"},
    )
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"run": "1"}
    items = client.responses.input_items.list(r.id)
    assert [(it.type, it.role) for it in items.data] == [("message", "user")] and items.data[0].id.startswith("msg_")
    assert items.data[0].content[0].text == "hello"
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)  # another key's response is unknown to it
    with pytest.raises(openai.BadRequestError) as exc:
        other.responses.create(model=MODEL, input="hello", previous_response_id=r.id)
    assert exc.value.code == "previous_response_not_found"
    client.responses.delete(r.id)  # the SDK returns None; the wire body is checked below
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_delete_answers_openais_body(stack, client):
    r = client.responses.create(model=MODEL, input="hello", temperature=0)
    got = httpx.delete(f"{stack.http_url}/v1/responses/{r.id}", headers={"Authorization": f"Bearer {KEY}"})
    assert got.status_code == 200 and got.json() == {"id": r.id, "object": "response", "deleted": True}


def test_a_background_response_completes_and_a_running_one_cancels(client):
    r = client.responses.create(model=MODEL, input="hello there", temperature=0, background=True)
    assert r.status in ("queued", "in_progress") and r.background
    done = wait_until(
        lambda: (x := client.responses.retrieve(r.id)).status not in ("queued", "in_progress") and x,
        60,
        "the background response to finish",
    )
    assert done.status == "completed" and done.output_text == "Hello! How can I help?"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(client.responses.create(model=MODEL, input="hello", store=True).id)
    # a long one (no cap, llama-server stops at its context), cancelled while it runs
    slow = client.responses.create(model=MODEL, input="tell me a story " * 50, background=True, temperature=1.5)
    cancelled = client.responses.cancel(slow.id)
    assert cancelled.status in ("cancelled", "completed", "incomplete")
    assert client.responses.retrieve(slow.id).status == cancelled.status


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}
                ]
            },
            "input[0].content[0].image_url",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "temperature": 7}, "temperature"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(stack, body, param):
    r = httpx.post(
        f"{stack.http_url}/v1/responses",
        json={"model": MODEL, **body},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def _agent_run(stack, streamed: bool) -> tuple[list[str], object]:
    from agents import Agent, FunctionTool, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    asked: list[str] = []

    async def get_weather(_ctx: object, arguments: str) -> str:
        city = json.loads(arguments)["city"]
        asked.append(city)
        return f"It is sunny in {city}."

    # the schema the tool model was trained on, as is (the decorator's would add titles and a strict schema)
    tool = FunctionTool(
        name="get_weather",
        description=TOOL["description"],
        params_json_schema=TOOL["parameters"],
        on_invoke_tool=get_weather,
        strict_json_schema=False,
    )

    async def run() -> object:
        api = openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        agent = Agent(
            name="weather",
            tools=[tool],
            tool_use_behavior="stop_on_first_tool",
            model=OpenAIResponsesModel(model=MODEL, openai_client=api),
        )
        if not streamed:
            return await Runner.run(agent, WEATHER, max_turns=3)
        result = Runner.run_streamed(agent, WEATHER, max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    return asked, asyncio.run(run())


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agent_with_one_function_tool_runs_to_completion(stack, streamed):
    asked, result = _agent_run(stack, streamed)
    assert asked == ["Paris"]  # the model called the tool, and the SDK ran it
    assert result.final_output == "It is sunny in Paris."


# What Codex CLI 0.171 sends (docs/api.md, Responses): tools it cannot turn off (a namespace of MCP tools, a custom
# apply_patch, web_search), developer items, store false, include, prompt_cache_key, no max_output_tokens, and
# its session headers.
CODEX_TOOLS = [SHELL, PATCH, WEB_SEARCH, MCP]
CODEX_INPUT = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: none"}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello there"}]},
]


def _codex_headers(session: str) -> dict[str, str]:
    return {
        "session-id": session,
        "thread-id": session,
        "x-codex-turn-metadata": '{"turn_id":"t1"}',
        "originator": "codex_exec",
        "OpenAI-Beta": "responses=experimental",
    }


def test_a_codex_shaped_turn_streams_openais_events_and_keeps_nothing(client):
    raw = client.responses.with_raw_response.create(
        model=MODEL,
        input=CODEX_INPUT,
        instructions="You are Codex.",
        tools=CODEX_TOOLS,
        tool_choice="auto",
        parallel_tool_calls=False,
        store=False,
        stream=True,
        include=["reasoning.encrypted_content"],
        prompt_cache_key="codex-thread-1",
        temperature=0,
        extra_headers=_codex_headers("codex-thread-1"),
    )
    assert raw.http_response.status_code == 200
    assert "web_search" in raw.headers["coderai-warning"]
    events = list(raw.parse())
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    first_delta = kinds.index("response.output_text.delta")
    assert kinds[:first_delta] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[first_delta:].count("response.output_text.done") == 1
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[-1].response
    # the tool model was trained on get_weather alone: beside Codex's tools it says something else than usual
    assert done.status == "completed" and done.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == done.output_text
    assert done.usage.input_tokens > 0 and done.usage.output_tokens > 0 and done.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done.id)  # store: false keeps nothing


def test_the_sdk_stream_helper_reads_a_codex_shaped_turn(client):
    seen: list[str] = []
    with client.responses.stream(
        model=MODEL,
        input=CODEX_INPUT,
        store=False,
        temperature=0,
        extra_body={
            "tools": CODEX_TOOLS,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "codex-thread-2",
        },
        extra_headers=_codex_headers("codex-thread-2"),
    ) as stream:
        for event in stream:
            seen.append(event.type)
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text and final.usage.total_tokens > 0
    assert (
        seen.index("response.output_item.added")
        < seen.index("response.content_part.added")
        < seen.index("response.output_text.delta")
    )
    assert seen[-1] == "response.completed"


def test_codex_turns_of_one_session_keep_to_one_engine(client):
    """The session Codex names (its `session-id` header or, without it, `prompt_cache_key`) is the affinity
    session: a turn after the first is routed by it."""
    for how in ({"extra_headers": _codex_headers("codex-thread-3")}, {"extra_body": {"prompt_cache_key": "pck-4"}}):
        first = client.responses.with_raw_response.create(model=MODEL, input="hello", store=False, temperature=0, **how)
        again = client.responses.with_raw_response.create(
            model=MODEL, input="hello again", store=False, temperature=0, **how
        )
        assert again.headers["coderai-route"] == "session", how
        assert again.headers["coderai-engine"] == first.headers["coderai-engine"]
        assert "coderai-warning" not in again.headers
