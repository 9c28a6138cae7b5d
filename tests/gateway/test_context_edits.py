"""Anthropic's `context_management` edits as Claude Code sends them (`clear_thinking_20251015` with `keep: "all"`)
and as the API documents them (`clear_tool_uses_20250919`): old tool results cleared past the trigger, the last
`keep` kept, excluded tools never cleared; old thinking dropped; what was cleared is reported as `applied_edits`."""

from __future__ import annotations

import msgspec
import pytest

from coderai.contracts import Choice, Usage
from coderai.gateway import anthropic_types as wire
from coderai.gateway.errors import ApiError


def _conversation(n: int, result: str = "x" * 400) -> list[dict]:
    out: list[dict] = [{"role": "user", "content": "look around"}]
    for i in range(n):
        name = "Memory" if i == 0 else "Read"
        out.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": f"step {i}", "signature": ""},
                    {"type": "tool_use", "id": f"t{i}", "name": name, "input": {"file_path": f"/f{i}"}},
                ],
            }
        )
        out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": result}]})
    return out


def _req(messages: list[dict], edits: list[dict]) -> wire.MessagesRequest:
    return msgspec.convert(
        {"model": "m", "max_tokens": 10, "messages": messages, "context_management": {"edits": edits}},
        wire.MessagesRequest,
    )


def _results(messages: list[dict]) -> dict[str, object]:
    return {
        b["tool_use_id"]: b["content"]
        for m in messages
        if isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    }


def test_old_tool_results_are_cleared_past_the_trigger_keeping_the_last_and_the_excluded():
    edit = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "input_tokens", "value": 200},
        "keep": {"type": "tool_uses", "value": 2},
        "exclude_tools": ["Memory"],
        "clear_tool_inputs": True,
    }
    messages, applied = wire.context_edited(_req(_conversation(6), [edit]))
    results = _results(messages)
    assert [k for k, v in results.items() if v == wire.CLEARED] == ["t1", "t2", "t3"]
    assert results["t0"] != wire.CLEARED and results["t4"] != wire.CLEARED and results["t5"] != wire.CLEARED
    inputs = {
        b["id"]: b["input"]
        for m in messages
        if m["role"] == "assistant"
        for b in m["content"]
        if b["type"] == "tool_use"
    }
    assert inputs["t1"] == {} and inputs["t5"] == {"file_path": "/f5"}
    assert applied == [
        {
            "type": "clear_tool_uses_20250919",
            "cleared_tool_uses": 3,
            "cleared_input_tokens": applied[0]["cleared_input_tokens"],
        }
    ]
    assert applied[0]["cleared_input_tokens"] > 3 * 100  # the three 400-character results
    job = wire.chat_job(_req(_conversation(6), [edit]), "r", messages)
    assert sum(1 for m in job.messages if m["role"] == "tool" and m["content"] == wire.CLEARED) == 3


def test_under_the_trigger_nothing_is_cleared():
    edit = {"type": "clear_tool_uses_20250919"}  # Anthropic's default trigger: 100,000 input tokens
    messages, applied = wire.context_edited(_req(_conversation(6), [edit]))
    assert applied == [] and wire.CLEARED not in _results(messages).values()


def test_claude_codes_clear_thinking_keeping_all_changes_nothing_and_a_count_drops_old_thinking():
    conversation = _conversation(4)
    same, applied = wire.context_edited(_req(conversation, [{"type": "clear_thinking_20251015", "keep": "all"}]))
    assert same == conversation and applied == []
    fewer, applied = wire.context_edited(
        _req(conversation, [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}])
    )
    kept = [b["thinking"] for m in fewer if m["role"] == "assistant" for b in m["content"] if b["type"] == "thinking"]
    assert kept == ["step 3"] and applied[0]["cleared_thinking_turns"] == 3


def test_the_applied_edits_are_in_the_answer():
    body = wire.message_body(
        "r",
        "m",
        Choice(message={"content": "ok"}, finish_reason="stop"),
        Usage(),
        [{"type": "clear_tool_uses_20250919", "cleared_tool_uses": 1, "cleared_input_tokens": 9}],
    )
    assert body["context_management"] == {
        "applied_edits": [{"type": "clear_tool_uses_20250919", "cleared_tool_uses": 1, "cleared_input_tokens": 9}]
    }
    assert "context_management" not in wire.message_body("r", "m", None, Usage())


@pytest.mark.parametrize(
    "bad",
    [
        {"edits": "clear"},
        {"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": -1}}]},
        {"edits": [{"type": "clear_tool_uses_20250919", "trigger": 5}]},
        {"edits": [{"keep": "all"}]},
    ],
)
def test_a_malformed_edit_is_a_400_naming_it(bad):
    req = msgspec.convert(
        {"model": "m", "max_tokens": 10, "messages": _conversation(1), "context_management": bad}, wire.MessagesRequest
    )
    with pytest.raises(ApiError) as err:
        wire.context_edited(req)
    assert err.value.status == 400 and err.value.param.startswith("context_management.edits")


def test_an_edit_type_coderai_does_not_know_is_accepted_and_not_applied():
    conversation = _conversation(2)
    assert wire.context_edited(_req(conversation, [{"type": "compact_20260101"}])) == (conversation, [])
