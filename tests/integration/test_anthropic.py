"""Anthropic's Messages API with the official `anthropic` SDK against a real stack: the overfitted tool-calling
GGUF (coderai.testing.tool_gguf) behind llama-server, a keys file, the key sent as the SDK sends it (`x-api-key`)."""

from __future__ import annotations

import pytest

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow
KEY = "sk-anthropic-client-0123456789"
MODEL = "tools-ls"
WEATHER = [{"role": "user", "content": "what is the weather in Paris"}]
HELLO = [{"role": "user", "content": "hello there"}]
GREEDY = {"temperature": 0}  # this SDK leaves sampling out of its signature


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tool_gguf):
    from coderai.engine_worker.engines.llama_server import find_binary

    if find_binary() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    keys = tmp_path_factory.mktemp("anthropic-keys") / "keys.toml"
    write_keys(str(keys), [KeyRecord("claude", hash_key(KEY), ["inference"])])
    models = [
        {
            "name": MODEL,
            "engine": "llama-server",
            "path": str(tool_gguf),
            "params": {"parallel": 2, "n_ctx": 1024, "n_threads": 2},
        }
    ]
    with running_stack(
        tmp_path_factory.mktemp("anthropic"),
        models,
        gateway_args=("--api-keys-file", str(keys)),
        headers={"Authorization": f"Bearer {KEY}"},
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    import anthropic

    return anthropic.Anthropic(base_url=stack.http_url, api_key=KEY, max_retries=0, timeout=120)


def _prompt(usage) -> int:
    """The prompt's tokens: those the engine read anew and those it found in its cache."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def _tools():
    from coderai.testing.tool_gguf import TOOL

    fn = TOOL["function"]
    return [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}]


def _reply():
    from coderai.testing.tool_gguf import REPLY

    return REPLY


def test_a_whole_message(client):
    m = client.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=HELLO)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == _reply()
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert _prompt(m.usage) > 0 and m.usage.output_tokens > 0
    assert m._request_id == m.id[len("msg_") :]  # the SDK reads the `request-id` header
    # Claude Code's way: the beta route (`?beta=true`, `anthropic-beta`), system blocks with cache_control
    beta = client.beta.messages.create(
        model=MODEL,
        max_tokens=64,
        extra_body=GREEDY,
        betas=["context-1m-2025-08-07"],
        system=[{"type": "text", "text": "You are a test model.", "cache_control": {"type": "ephemeral"}}],
        messages=HELLO,
    )
    assert beta.content[0].text == _reply() and beta.stop_reason == "end_turn"


def test_a_streamed_message_is_the_same_text(client):
    with client.messages.stream(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=HELLO) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == _reply() == final.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0 and _prompt(final.usage) > 0


def test_max_tokens_and_stop_sequences(client):
    m = client.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=HELLO)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    m = client.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=HELLO, stop_sequences=["help"])
    assert m.content[0].text == _reply().split("help")[0]  # the engine stopped at the sequence


def _round_trip(client, first) -> None:
    """The tool's answer sent back as a tool_result: the model answers it with text."""
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert first.stop_reason == "tool_use"
    messages = [
        *WEATHER,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]},
    ]
    with client.messages.stream(model=MODEL, max_tokens=64, extra_body=GREEDY, tools=_tools(), messages=messages) as s:
        final = s.get_final_message()
    assert final.stop_reason == "end_turn" and [b.type for b in final.content] == ["text"] and final.content[0].text
    assert _prompt(final.usage) > _prompt(first.usage)  # the call and its result reached the prompt
    counted = client.messages.count_tokens(model=MODEL, tools=_tools(), messages=messages)
    assert counted.input_tokens == _prompt(final.usage)


def test_a_tool_round_trip_whole(client):
    first = client.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY, tools=_tools(), messages=WEATHER)
    _round_trip(client, first)


def test_a_tool_round_trip_streamed(client):
    with client.messages.stream(
        model=MODEL, max_tokens=64, extra_body=GREEDY, tools=_tools(), messages=WEATHER, tool_choice={"type": "any"}
    ) as s:
        events = list(s)
        first = s.get_final_message()
    assert [e.type for e in events[:1]] == ["message_start"] and events[-1].type == "message_stop"
    assert any(e.type == "input_json" for e in events)  # the arguments came as input_json_delta pieces
    _round_trip(client, first)


def test_count_tokens_is_the_prompt_the_engine_reads(client):
    whole = client.messages.create(
        model=MODEL, max_tokens=4, extra_body=GREEDY, system="You are a test model.", messages=HELLO
    )
    counted = client.messages.count_tokens(model=MODEL, system="You are a test model.", messages=HELLO)
    assert counted.input_tokens == _prompt(whole.usage) > 0
    with_tools = client.messages.count_tokens(
        model=MODEL, system="You are a test model.", messages=HELLO, tools=_tools()
    )
    assert with_tools.input_tokens > counted.input_tokens  # the template renders the tools into the prompt


def test_errors_are_the_sdks_exceptions(client, stack):
    import anthropic

    wrong = anthropic.Anthropic(base_url=stack.http_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        wrong.messages.create(model=MODEL, max_tokens=4, messages=HELLO)
    assert exc.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.create(model="ghost", max_tokens=4, messages=HELLO)
    assert exc.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model 'ghost' does not exist."},
    }
    with pytest.raises(anthropic.BadRequestError) as exc:  # the SDK's signature wants max_tokens: sent raw
        client.post("/v1/messages", cast_to=anthropic.types.Message, body={"model": MODEL, "messages": HELLO})
    assert exc.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in exc.value.message
    image = {"type": "image", "source": {"type": "url", "url": "http://169.254.169.254/latest"}}
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}])


def _claude_code_request(session: str, version: str) -> dict:
    """A first turn shaped like Claude Code 2.1's (issue 39): the billing block first in `system`, `system` entries
    in `messages`, betas, adaptive thinking, effort, context management, cache_control on blocks, its session in
    `metadata.user_id` and a header, `max_tokens` far above the model's context, several tools."""
    import json

    cached = {"type": "ephemeral"}
    tools = _tools() + [
        {
            "name": f"tool_{i}",
            "description": f"Tool {i}",
            "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}},
        }
        for i in range(5)
    ]
    tools[-1]["cache_control"] = cached
    return dict(
        model=MODEL,
        max_tokens=32000,
        tools=tools,
        betas=[
            "claude-code-20250219",
            "interleaved-thinking-2025-05-14",
            "context-management-2025-06-27",
            "mid-conversation-system-2026-04-07",
            "no-such-beta-2099-01-01",
        ],
        system=[
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version={version}; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are a test model.", "cache_control": cached},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "hello there", "cache_control": cached}]},
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        ],
        thinking={"type": "adaptive"},
        output_config={"effort": "medium"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        metadata={"user_id": json.dumps({"device_id": "dev", "account_uuid": "", "session_id": session})},
        extra_headers={"X-Claude-Code-Session-Id": session},
        extra_body=GREEDY,
    )


def test_a_first_turn_as_claude_code_sends_it(client):
    m = client.beta.messages.create(**_claude_code_request("sess-1", "2.1.197.a1b"))
    assert m.stop_reason in ("end_turn", "max_tokens") and m.content and _prompt(m.usage) > 0
    with client.beta.messages.stream(**_claude_code_request("sess-1", "2.1.197.a1b")) as s:
        streamed = s.get_final_message()
    assert _prompt(streamed.usage) == _prompt(m.usage)
    # another session's billing block is not in the prompt: the same tokens (and prefix) as the first
    other = client.beta.messages.create(**_claude_code_request("sess-2", "2.1.197.ffe"))
    assert _prompt(other.usage) == _prompt(m.usage)
    body = _claude_code_request("sess-1", "2.1.197.a1b")
    extra = {name: body.pop(name) for name in ("context_management", "output_config", "metadata")}
    for name in ("max_tokens", "betas"):
        body.pop(name)
    body["extra_body"] = extra  # this SDK's count_tokens takes none of them
    counted = client.beta.messages.count_tokens(**body, betas=["token-counting-2024-11-01", "no-such-beta"])
    assert counted.input_tokens == _prompt(m.usage)


def test_a_prompt_said_again_is_read_from_the_engines_cache(client):
    """`cache_read_input_tokens` are the engine's real prefix-cache hits: a system prompt sent twice is read the
    second time (Claude Code's ~20k tokens of tools and system prompt are what this saves)."""
    system = [{"type": "text", "text": "You are a test model. " * 20, "cache_control": {"type": "ephemeral"}}]
    first = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, system=system, messages=HELLO)
    again = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, system=system, messages=HELLO)
    whole = _prompt(first.usage)
    assert _prompt(again.usage) == whole
    assert again.usage.cache_read_input_tokens > whole // 2 and again.usage.cache_creation_input_tokens == 0
