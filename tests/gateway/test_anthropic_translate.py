"""Anthropic's Messages API at the edge: requests into chat jobs, answers and streamed frames into Anthropic's
message and events, errors into its shape; and `x-api-key` as the key."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from litestar.testing import TestClient

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.contracts import Choice, Chunk, Final, Usage
from coderai.gateway import anthropic_types as wire
from coderai.gateway.anthropic import Events, error_body
from coderai.gateway.app import create_app
from coderai.gateway.errors import ApiError
from coderai.gateway.http import parse
from coderai.gateway.seal import sealer
from coderai.gateway.settings import GatewaySettings

TOOL = {
    "name": "get_weather",
    "description": "The weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def job(**body):
    return wire.chat_job(
        parse(json.dumps({"model": "m", "max_tokens": 16, **body}).encode(), wire.MessagesRequest), "rid"
    )


def refused(**body) -> ApiError:
    with pytest.raises(ApiError) as exc:
        job(**body)
    assert exc.value.status == 400
    return exc.value


def test_max_tokens_is_required():
    with pytest.raises(ApiError) as exc:
        parse(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', wire.MessagesRequest)
    assert exc.value.status == 400 and exc.value.param == "max_tokens"


def test_system_text_blocks_and_sampling():
    j = job(
        system=[
            {"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "be kind"},
        ],
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        stop_sequences=["END"],
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        stream=True,
    )
    assert j.messages == [{"role": "system", "content": "be brief\nbe kind"}, {"role": "user", "content": "a\nb"}]
    assert (j.params.max_tokens, j.params.stop, j.params.temperature, j.params.top_p) == (16, ["END"], 0.5, 0.9)
    assert j.stream and j.tools is None and j.options is None


BILLING = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=sdk-cli; cch=00;"}


def test_system_entries_in_messages_are_merged_in_order():
    """Claude Code's `mid-conversation-system` beta: a leading system entry extends the system prompt, a later one
    heads the next user turn (after that turn's tool results), one at the end closes the last user turn."""
    j = job(
        system="base",
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "lead", "cache_control": {"type": "ephemeral"}}]},
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "reminder"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}]},
            {"role": "system", "content": "mid"},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a b"},
                    {"type": "text", "text": "go on"},
                ],
            },
            {"role": "system", "content": "last"},
        ],
    )
    assert [m["role"] for m in j.messages] == ["system", "user", "assistant", "tool", "user"]
    assert j.messages[0]["content"] == "base\nlead"
    assert j.messages[-1]["content"] == "reminder\nmid\ngo on\nlast"
    j = job(
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yes"},
            {"role": "system", "content": "now"},
        ]
    )
    assert j.messages[-1] == {"role": "user", "content": "now"}


def test_the_billing_block_is_out_of_the_prompt_and_its_prefix():
    from coderai.gateway import affinity

    sys = [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    one = job(system=[BILLING, *sys], messages=[{"role": "user", "content": "hi"}])
    two = job(
        system=[{**BILLING, "text": BILLING["text"].replace("a1b", "ffe")}, *sys],
        messages=[{"role": "user", "content": "hi"}],
    )
    assert (
        one.messages
        == two.messages
        == [{"role": "system", "content": "You are Claude Code."}, {"role": "user", "content": "hi"}]
    )
    assert affinity.chat_chain("m", one.messages) == affinity.chat_chain("m", two.messages)


def test_claude_codes_session_is_the_session_key():
    hi = [{"role": "user", "content": "x"}]

    def req(uid):
        return parse(
            json.dumps({"model": "m", "max_tokens": 1, "messages": hi, "metadata": {"user_id": uid}}).encode(),
            wire.MessagesRequest,
        )

    as_json = req(json.dumps({"device_id": "d1", "account_uuid": "", "session_id": "s-1"}))
    assert wire.session_id(as_json, None) == "s-1" and wire.session_id(as_json, "hdr") == "hdr"
    other_session = req(json.dumps({"device_id": "d1", "session_id": "s-2"}))
    assert wire.user_id(as_json) == wire.user_id(other_session) == '{"device_id": "d1"}'
    legacy = req("user_abc_account_u1_session_s-9")
    assert (wire.user_id(legacy), wire.session_id(legacy, None)) == ("user_abc_account_u1", "s-9")
    plain = req("alice")
    assert (wire.user_id(plain), wire.session_id(plain, None)) == ("alice", None)


def test_claude_codes_other_fields_are_accepted():
    j = job(
        max_tokens=32000,
        thinking={"type": "adaptive"},
        output_config={"effort": "max"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        metadata={"user_id": "u"},
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            }
        ],
    )
    assert j.params.max_tokens == 32000 and j.messages == [{"role": "user", "content": "hi"}]
    assert j.options == {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "high"}
    off = job(
        thinking={"type": "disabled"}, output_config={"effort": "low"}, messages=[{"role": "user", "content": "x"}]
    )
    assert off.options == {"chat_template_kwargs": {"enable_thinking": False}}


def test_images_are_data_urls_and_urls_are_refused():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    j = job(messages=[{"role": "user", "content": [{"type": "text", "text": "what is this"}, image]}])
    assert j.messages[0]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    err = refused(
        messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://10.0.0.1/x.png"}}]}
        ]
    )
    assert err.code == "invalid_image_url" and err.param == "messages[0].content[0].source"


def test_a_tool_round_trip_becomes_openai_tool_calls_and_tool_messages():
    j = job(
        tools=[TOOL],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        messages=[
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "thinking",
                        "thinking": "look it up",  # as this gateway signed it
                        "signature": sealer().sign("look it up"),
                    },
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_abc", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "and tomorrow?"},
                ],
            },
        ],
    )
    assert j.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": TOOL["input_schema"],
                "description": "The weather of a city",
            },
        }
    ]
    assert j.tool_choice == "auto" and j.options == {"parallel_tool_calls": False}
    user, assistant, tool, after = j.messages
    assert assistant == {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "look it up",
        "tool_calls": [
            {"id": "abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    }
    assert tool == {"role": "tool", "tool_call_id": "abc", "content": "sunny"}  # the engine's id again
    assert after == {"role": "user", "content": "and tomorrow?"}


def test_tool_result_images_follow_as_a_user_message():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "BBBB"}}
    j = job(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "shot"}, image]}
                ],
            }
        ]
    )
    assert j.messages == [
        {"role": "tool", "tool_call_id": "t1", "content": "shot"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,BBBB"}}]},
    ]


@pytest.mark.parametrize(
    "choice, expected",
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
def test_tool_choice(choice, expected):
    assert job(tools=[TOOL], tool_choice=choice, messages=[{"role": "user", "content": "x"}]).tool_choice == expected


def test_bad_tools_and_choices_are_400s():
    hi = [{"role": "user", "content": "x"}]
    assert (
        refused(tools=[{"type": "web_search_20250305", "name": "web_search"}], messages=hi).code == "unsupported_tool"
    )
    assert refused(tools=[TOOL], tool_choice={"type": "sometimes"}, messages=hi).param == "tool_choice"
    assert refused(tool_choice={"type": "any"}, messages=hi).param == "tool_choice"  # no tools to choose from
    assert refused(messages=[{"role": "tool", "content": "x"}]).param == "messages[0].role"
    assert refused(messages=[{"role": "system", "content": 3}]).param == "messages[0].content"
    assert refused(messages=[{"role": "user", "content": [{"type": "video"}]}]).param == "messages[0].content[0]"
    assert refused(thinking={"type": "enabled"}, messages=hi).param == "thinking.budget_tokens"


def test_thinking_is_the_templates_switch():
    hi = [{"role": "user", "content": "x"}]
    on = job(thinking={"type": "enabled", "budget_tokens": 1024}, messages=hi).options
    assert on == {"chat_template_kwargs": {"enable_thinking": True}}
    assert job(thinking={"type": "disabled"}, messages=hi).options == {
        "chat_template_kwargs": {"enable_thinking": False}
    }


def test_a_token_count_is_the_prompt_answered_with_one_token():
    req = parse(
        json.dumps(
            {
                "model": "m",
                "tools": [TOOL],
                "tool_choice": {"type": "any"},
                "messages": [{"role": "user", "content": "x"}],
            }
        ).encode(),
        wire.CountTokensRequest,
    )
    j = wire.chat_job(req, "rid")
    assert j.params.max_tokens == 1 and not j.stream and j.tools and j.tool_choice is None


def test_the_whole_answer_as_a_message():
    choice = Choice(
        message={
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "hmm",
            "tool_calls": [
                {"id": "c9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        finish_reason="tool_calls",
    )
    body = wire.message_body("r1", "m", choice, Usage(prompt_tokens=7, completion_tokens=3, total_tokens=10))
    assert body["id"] == "msg_r1" and body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [
        {"type": "thinking", "thinking": "hmm", "signature": sealer().sign("hmm")},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_c9", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert body["stop_reason"] == "tool_use" and body["usage"] == {
        "input_tokens": 7,
        "output_tokens": 3,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    for finish, reason in (("stop", "end_turn"), ("length", "max_tokens"), (None, "end_turn")):
        assert (
            wire.message_body("r", "m", Choice(message={"content": "x"}, finish_reason=finish), Usage())["stop_reason"]
            == reason
        )


def test_tool_use_ids_round_trip():
    assert wire.engine_call_id(wire.tool_use_id("abc")) == "abc"
    assert wire.tool_use_id("toolu_x") == "toolu_x"
    assert wire.tool_use_id(None).startswith("toolu_") and wire.tool_use_id(None) != wire.tool_use_id(None)


def _events(data: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in data.decode().split("\n\n"):
        if block:
            name, payload = block.split("\n")
            assert name.startswith("event: ") and payload.startswith("data: ")
            out.append((name[7:], json.loads(payload[6:])))
            assert out[-1][0] == out[-1][1]["type"]
    return out


def test_streamed_frames_become_anthropics_event_sequence():
    ev = Events("r2", "m")
    frames = [
        Chunk(seq=1, delta={"role": "assistant", "reasoning_content": "hm"}),
        Chunk(seq=2, delta={"content": "Let me"}),
        Chunk(seq=3, delta={"content": " check."}),
        Chunk(
            seq=4,
            delta={
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"ci'},
                    }
                ]
            },
        ),
        Chunk(
            seq=5,
            delta={"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]},
            finish_reason="tool_calls",
        ),
    ]
    data = b"".join(ev.chunk(f) for f in frames)
    data += asyncio.run(ev.final(Final(seq=6, engine_id="e", usage=Usage(prompt_tokens=5, completion_tokens=9))))
    names = [n for n, _ in _events(data)]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]  # the thinking block's second delta: its signature
    events = [e for _, e in _events(data)]
    assert events[0]["message"]["id"] == "msg_r2" and events[0]["message"]["content"] == []
    assert events[3]["delta"] == {"type": "thinking_delta", "thinking": "hm"}
    assert events[4]["delta"] == {"type": "signature_delta", "signature": sealer().sign("hm")}
    assert events[6]["index"] == 1 and events[7]["delta"] == {"type": "text_delta", "text": "Let me"}
    assert events[10]["content_block"] == {"type": "tool_use", "id": "toolu_c1", "name": "get_weather", "input": {}}
    args = "".join(e["delta"]["partial_json"] for e in events[11:13])
    assert json.loads(args) == {"city": "Paris"} and events[13] == {"type": "content_block_stop", "index": 2}
    assert events[14]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[14]["usage"] == {
        "input_tokens": 5,
        "output_tokens": 9,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }


def test_an_empty_stream_and_a_failure_mid_stream():
    ev = Events("r3", "m")
    data = asyncio.run(ev.final(Final(seq=1, engine_id="e")))
    assert [n for n, _ in _events(data)] == ["message_start", "ping", "message_delta", "message_stop"]
    ev = Events("r4", "m")
    data = ev.chunk(Chunk(seq=1, delta={"content": "x"})) + ev.error(ApiError(502, "engine died", type="engine_error"))
    assert _events(data)[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "engine died"}})


@pytest.mark.parametrize(
    "status, kind",
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (415, "invalid_request_error"),
        (429, "rate_limit_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "api_error"),
    ],
)
def test_error_types(status, kind):
    assert error_body(status, "m") == {"type": "error", "error": {"type": kind, "message": "m"}}


KEY = "sk-anthropic-translate"


@pytest.fixture(scope="module")
def client(nats_server, tmp_path_factory):
    keys = tmp_path_factory.mktemp("anthropic") / "keys.toml"
    write_keys(str(keys), [KeyRecord("u", hash_key(KEY), ["inference"])])
    with TestClient(create_app(GatewaySettings(nats_url=nats_server.url, api_keys_file=str(keys)))) as c:
        yield c


def test_x_api_key_is_the_key_and_the_guards_401_is_anthropics(client):
    assert client.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
    r = client.get("/v1/models", headers={"x-api-key": KEY, "Authorization": "Bearer sk-wrong"})
    assert r.status_code == 401  # Authorization, when sent, is the key
    for headers in ({}, {"x-api-key": "sk-wrong", "anthropic-version": "2023-06-01"}):
        r = client.post("/v1/messages", headers=headers, json={"model": "m", "max_tokens": 1, "messages": []})
        assert r.status_code == 401 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "authentication_error"
    r = client.post("/v1/messages", headers={"x-api-key": KEY}, content=b"{")
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post(
        "/v1/messages",
        headers={"x-api-key": KEY},
        json={"model": "ghost", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 404 and msgspec.json.decode(r.content)["error"]["type"] == "not_found_error"


def test_claude_codes_recorded_first_turn():
    """The body Claude Code 2.1.328 (`claude -p "say hi"`) sent to `/v1/messages?beta=true`, recorded: its system
    entry after the user turn, adaptive thinking, effort, context management and its session translate."""
    from pathlib import Path

    body = (Path(__file__).parent / "data" / "claude_code_2.1.328_first_turn.json").read_bytes()
    req = parse(body, wire.MessagesRequest)
    j = wire.chat_job(req, "rid")
    assert [m["role"] for m in j.messages] == ["system", "user"] and j.params.max_tokens == 32000
    assert not j.messages[0]["content"].startswith("x-anthropic-billing-header")
    assert "say hi" in j.messages[1]["content"] and "# Environment" in j.messages[1]["content"]
    assert len(j.tools) == len(req.tools) > 10 and j.stream
    assert j.options == {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "high"}
    session = json.loads(req.metadata["user_id"])["session_id"]
    assert wire.session_id(req, None) == session
    assert wire.chat_job(parse(body, wire.CountTokensRequest), "rid").messages == j.messages
