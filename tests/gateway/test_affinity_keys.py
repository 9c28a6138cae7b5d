"""Affinity keys are pure digests: stable for the same input, different for a different model, and chained so a
conversation that grows keeps the earlier request's keys as a prefix."""

from __future__ import annotations

import re

import pytest

from coderai.gateway.affinity import CHUNK_CHARS, MAX_CHAIN, chat_chain, prompt_chain, session_key, user_key

HEX32 = re.compile(r"[0-9a-f]{32}")

SYSTEM = {"role": "system", "content": "You are terse."}
USER1 = {"role": "user", "content": "What is 2+2?"}
ASSISTANT1 = {"role": "assistant", "content": "4"}
USER2 = {"role": "user", "content": "And 3+3?"}
ASSISTANT2 = {"role": "assistant", "content": "6"}
USER3 = {"role": "user", "content": "Thanks."}

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


def conversation(turns: int) -> list[dict]:
    """A system prompt and `turns` user/assistant pairs, ending with a user turn."""
    msgs: list[dict] = [SYSTEM]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"question {i}"})
        msgs.append({"role": "assistant", "content": f"answer {i}"})
    msgs.append({"role": "user", "content": "last question"})
    return msgs


def test_session_and_user_keys_are_empty_without_input():
    assert session_key("m", None) == ""
    assert session_key("m", "") == ""
    assert user_key("m", None) == ""
    assert user_key("m", "") == ""


def test_session_and_user_keys_are_stable_hex_digests():
    assert session_key("m", "s1") == session_key("m", "s1")
    assert user_key("m", "alice") == user_key("m", "alice")
    assert HEX32.fullmatch(session_key("m", "s1"))
    assert HEX32.fullmatch(user_key("m", "alice"))


def test_session_and_user_keys_differ_by_model_and_value():
    assert session_key("a", "s1") != session_key("b", "s1")
    assert session_key("m", "s1") != session_key("m", "s2")
    assert user_key("a", "alice") != user_key("b", "alice")
    assert user_key("m", "alice") != user_key("m", "bob")


def test_session_and_user_keys_do_not_collide_with_each_other():
    # The same string as a session id and as a user must not land on the same affinity entry.
    assert session_key("m", "x") != user_key("m", "x")


def test_keys_do_not_run_model_and_value_together():
    # Length-prefixed parts: ("ab", "c") and ("a", "bc") are different keys.
    assert session_key("ab", "c") != session_key("a", "bc")
    assert user_key("ab", "c") != user_key("a", "bc")


def test_chat_chain_has_one_element_per_message_after_the_first_user_turn():
    assert len(chat_chain("m", [SYSTEM, USER1])) == 1
    assert len(chat_chain("m", [USER1])) == 1
    assert len(chat_chain("m", [SYSTEM, USER1, ASSISTANT1, USER2])) == 3
    chain = chat_chain("m", [SYSTEM, USER1, ASSISTANT1, USER2, ASSISTANT2, USER3])
    assert len(chain) == 5
    assert len(set(chain)) == 5
    assert all(HEX32.fullmatch(h) for h in chain)


def test_chat_chain_is_deterministic():
    msgs = [SYSTEM, USER1, ASSISTANT1, USER2]
    assert chat_chain("m", msgs, TOOLS) == chat_chain("m", [dict(m) for m in msgs], [dict(t) for t in TOOLS])


def test_chat_chain_is_empty_without_a_user_message():
    assert chat_chain("m", []) == []
    assert chat_chain("m", [SYSTEM]) == []
    assert chat_chain("m", [SYSTEM, ASSISTANT1], TOOLS) == []


def test_a_request_that_extends_a_conversation_shares_its_whole_chain():
    first = chat_chain("m", [SYSTEM, USER1])
    second = chat_chain("m", [SYSTEM, USER1, ASSISTANT1, USER2])
    third = chat_chain("m", [SYSTEM, USER1, ASSISTANT1, USER2, ASSISTANT2, USER3])
    assert second[:1] == first
    assert third[:3] == second
    assert len(third) == 5


def test_each_later_message_extends_the_chain_including_assistant_and_tool_turns():
    base = [SYSTEM, USER1]
    tool_call = {
        "role": "assistant",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
    }
    tool_result = {"role": "tool", "tool_call_id": "c1", "content": "4"}
    chain = chat_chain("m", base + [tool_call, tool_result])
    assert len(chain) == 3
    other_result = chat_chain("m", base + [tool_call, {**tool_result, "content": "5"}])
    assert other_result[:2] == chain[:2]
    assert other_result[2] != chain[2]


def test_a_different_later_message_changes_only_that_element_and_after():
    a = chat_chain("m", [SYSTEM, USER1, ASSISTANT1, USER2, ASSISTANT2, USER3])
    b = chat_chain("m", [SYSTEM, USER1, {"role": "assistant", "content": "four"}, USER2, ASSISTANT2, USER3])
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda model, msgs, tools: ("other", msgs, tools), id="model"),
        pytest.param(
            lambda model, msgs, tools: (model, [{"role": "system", "content": "Be verbose."}] + msgs[1:], tools),
            id="system",
        ),
        pytest.param(
            lambda model, msgs, tools: (
                model,
                [msgs[0], {"role": "user", "content": "What is 2+3?"}] + msgs[2:],
                tools,
            ),
            id="first-user",
        ),
        pytest.param(lambda model, msgs, tools: (model, msgs, None), id="tools-removed"),
        pytest.param(lambda model, msgs, tools: (model, msgs, [{**TOOLS[0], "type": "other"}]), id="tools-changed"),
        pytest.param(lambda model, msgs, tools: (model, msgs[1:], tools), id="system-removed"),
    ],
)
def test_changing_what_h1_covers_changes_every_element(change):
    model, msgs, tools = "m", [SYSTEM, USER1, ASSISTANT1, USER2], TOOLS
    base = chat_chain(model, msgs, tools)
    changed = chat_chain(*change(model, msgs, tools))
    assert len(changed) == len(base) == 3
    assert not set(base) & set(changed)


def test_no_tools_and_an_empty_tool_list_are_the_same_prompt():
    msgs = [SYSTEM, USER1]
    assert chat_chain("m", msgs) == chat_chain("m", msgs, None) == chat_chain("m", msgs, [])


def test_developer_messages_count_like_system_messages_in_h1():
    dev = {"role": "developer", "content": "Answer in French."}
    assert chat_chain("m", [dev, USER1]) != chat_chain("m", [USER1])
    assert chat_chain("m", [SYSTEM, dev, USER1]) != chat_chain("m", [SYSTEM, USER1])
    # Order of the instructions is part of the prompt.
    assert chat_chain("m", [SYSTEM, dev, USER1]) != chat_chain("m", [dev, SYSTEM, USER1])


def test_every_message_before_the_first_user_turn_is_part_of_h1():
    # A leading assistant turn (a greeting, few-shot examples) is part of the prompt the engine caches.
    greeting = {"role": "assistant", "content": "Hello! How can I help?"}
    with_greeting = chat_chain("m", [SYSTEM, greeting, USER1, ASSISTANT1, USER2])
    without = chat_chain("m", [SYSTEM, USER1, ASSISTANT1, USER2])
    assert len(with_greeting) == len(without) == 3
    assert not set(with_greeting) & set(without)


def test_only_the_first_user_message_goes_into_h1():
    # A second user turn is a chain element of its own, not part of h1.
    one = chat_chain("m", [SYSTEM, USER1])
    two = chat_chain("m", [SYSTEM, USER1, USER2])
    assert two[0] == one[0]
    assert len(two) == 2


def test_system_messages_after_the_first_user_turn_extend_the_chain_instead_of_changing_h1():
    late_system = {"role": "system", "content": "Now be verbose."}
    chain = chat_chain("m", [SYSTEM, USER1, late_system])
    assert chain[0] == chat_chain("m", [SYSTEM, USER1])[0]
    assert len(chain) == 2


def test_an_image_part_changes_the_hash_of_its_message():
    text = {"type": "text", "text": "What is in this picture?"}

    def image(url: str) -> dict:
        return {"type": "image_url", "image_url": {"url": url}}

    only_text = chat_chain("m", [{"role": "user", "content": [text]}])
    cat = chat_chain("m", [{"role": "user", "content": [text, image("data:image/png;base64,Y2F0")]}])
    dog = chat_chain("m", [{"role": "user", "content": [text, image("data:image/png;base64,ZG9n")]}])
    assert len({only_text[0], cat[0], dog[0]}) == 3

    # In a later turn, the image changes that element and the ones after it, not the ones before.
    later_cat = chat_chain("m", [USER1, ASSISTANT1, {"role": "user", "content": [text, image("cat.png")]}, ASSISTANT2])
    later_dog = chat_chain("m", [USER1, ASSISTANT1, {"role": "user", "content": [text, image("dog.png")]}, ASSISTANT2])
    assert later_cat[:2] == later_dog[:2]
    assert later_cat[2] != later_dog[2]
    assert later_cat[3] != later_dog[3]


def test_string_content_and_an_equivalent_text_part_are_different_messages():
    # The hash is over the JSON the client sent, not a normalised form.
    as_string = chat_chain("m", [{"role": "user", "content": "hi"}])
    as_parts = chat_chain("m", [{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert as_string != as_parts


def test_dict_key_order_does_not_change_the_chain():
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u", "detail": "low"}}], "name": "al"},
        {"role": "assistant", "content": "ok"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "d"}}]
    reordered_msgs = [
        {"content": "sys", "role": "system"},
        {"name": "al", "content": [{"image_url": {"detail": "low", "url": "u"}, "type": "image_url"}], "role": "user"},
        {"content": "ok", "role": "assistant"},
    ]
    reordered_tools = [{"function": {"description": "d", "name": "f"}, "type": "function"}]
    assert chat_chain("m", msgs, tools) == chat_chain("m", reordered_msgs, reordered_tools)


def test_message_boundaries_are_part_of_the_hash():
    # Moving text from one message to the next must not give the same chain.
    a = chat_chain("m", [{"role": "system", "content": "ab"}, {"role": "user", "content": "c"}])
    b = chat_chain("m", [{"role": "system", "content": "a"}, {"role": "user", "content": "bc"}])
    assert a != b


def test_a_chain_at_max_length_is_not_bounded():
    msgs = [USER1] + [{"role": "assistant", "content": str(i)} for i in range(MAX_CHAIN - 1)]
    chain = chat_chain("m", msgs)
    assert len(chain) == MAX_CHAIN


def test_a_long_chain_keeps_h1_and_its_last_elements():
    extra = 10
    msgs = [USER1] + [{"role": "assistant", "content": str(i)} for i in range(MAX_CHAIN + extra - 1)]
    raw = [chat_chain("m", msgs[:k])[-1] for k in range(1, len(msgs) + 1)]  # a bounded chain keeps its last element
    chain = chat_chain("m", msgs)
    assert len(raw) == MAX_CHAIN + extra
    assert len(chain) == MAX_CHAIN
    assert chain[0] == raw[0] == chat_chain("m", [USER1])[0]
    assert chain[1:] == raw[-(MAX_CHAIN - 1) :]
    assert not set(raw[1 : extra + 1]) & set(chain)  # the early middle is what goes
    assert len(set(chain)) == MAX_CHAIN


def test_the_next_turn_of_a_long_conversation_still_finds_the_previous_last_element():
    prev = conversation(MAX_CHAIN)  # a chain well past the bound
    prev_chain = chat_chain("m", prev)
    nxt = prev + [{"role": "assistant", "content": "last answer"}, {"role": "user", "content": "one more"}]
    next_chain = chat_chain("m", nxt)
    assert len(prev_chain) == len(next_chain) == MAX_CHAIN
    assert next_chain[0] == prev_chain[0]
    assert prev_chain[-1] in next_chain
    assert next_chain.index(prev_chain[-1]) == MAX_CHAIN - 3


def test_chains_differ_by_model():
    msgs = [SYSTEM, USER1, ASSISTANT1]
    assert not set(chat_chain("a", msgs)) & set(chat_chain("b", msgs))


def test_prompt_chain_has_one_element_per_full_chunk():
    assert prompt_chain("m", "") == []
    assert prompt_chain("m", "x" * (CHUNK_CHARS - 1)) == []
    assert len(prompt_chain("m", "x" * CHUNK_CHARS)) == 1
    assert len(prompt_chain("m", "x" * (CHUNK_CHARS + 1))) == 1
    assert len(prompt_chain("m", "x" * (3 * CHUNK_CHARS))) == 3
    assert len(prompt_chain("m", "x" * (3 * CHUNK_CHARS + CHUNK_CHARS - 1))) == 3


def test_prompt_chain_elements_are_distinct_even_for_repeated_chunks():
    chain = prompt_chain("m", "x" * (4 * CHUNK_CHARS))
    assert len(set(chain)) == 4
    assert all(HEX32.fullmatch(h) for h in chain)


def test_a_partial_last_chunk_is_ignored():
    body = "a" * CHUNK_CHARS + "b" * CHUNK_CHARS
    assert prompt_chain("m", body + "tail one") == prompt_chain("m", body + "another tail") == prompt_chain("m", body)


def test_a_prompt_that_extends_another_shares_its_chain():
    short = "".join(chr(ord("a") + i % 26) for i in range(2 * CHUNK_CHARS + 100))
    long = short + "z" * (3 * CHUNK_CHARS)
    assert prompt_chain("m", long)[:2] == prompt_chain("m", short)
    assert len(prompt_chain("m", long)) == 5


def test_a_changed_chunk_changes_that_element_and_after():
    a = "a" * CHUNK_CHARS + "b" * CHUNK_CHARS + "c" * CHUNK_CHARS
    b = "a" * CHUNK_CHARS + "B" + "b" * (CHUNK_CHARS - 1) + "c" * CHUNK_CHARS
    ca, cb = prompt_chain("m", a), prompt_chain("m", b)
    assert ca[0] == cb[0]
    assert ca[1] != cb[1] and ca[2] != cb[2]


def test_prompt_chain_differs_by_model_and_is_deterministic():
    p = "p" * (2 * CHUNK_CHARS)
    assert prompt_chain("m", p) == prompt_chain("m", p)
    assert not set(prompt_chain("a", p)) & set(prompt_chain("b", p))


def test_prompt_chain_honours_a_custom_chunk_size():
    assert len(prompt_chain("m", "abcdefg", chunk_chars=2)) == 3
    assert prompt_chain("m", "abcdefg", chunk_chars=2) == prompt_chain("m", "abcdef", chunk_chars=2)
    assert prompt_chain("m", "abcdefg", chunk_chars=2)[:1] == prompt_chain("m", "ab", chunk_chars=2)
    assert prompt_chain("m", "abcd", chunk_chars=2) != prompt_chain("m", "abcd", chunk_chars=1)[:2]


def test_prompt_chain_chunks_by_characters_not_bytes():
    # Multi-byte characters still count once each.
    assert len(prompt_chain("m", "é" * CHUNK_CHARS)) == 1
    assert len(prompt_chain("m", "😀" * (2 * CHUNK_CHARS))) == 2


def test_a_long_prompt_chain_is_bounded_like_a_chat_chain():
    n = MAX_CHAIN + 20
    prompt = "".join(chr(0x4E00 + i) * CHUNK_CHARS for i in range(n))
    raw = [prompt_chain("m", prompt[: k * CHUNK_CHARS])[-1] for k in range(1, n + 1)]
    chain = prompt_chain("m", prompt)
    assert len(chain) == MAX_CHAIN
    assert chain == raw[:1] + raw[-(MAX_CHAIN - 1) :]
    # The next, longer prompt still contains this one's last element.
    assert chain[-1] in prompt_chain("m", prompt + "q" * CHUNK_CHARS)


def test_prompt_and_chat_keys_never_collide():
    # A completion prompt and a chat conversation with the same text are different caches.
    text = "x" * CHUNK_CHARS
    assert not set(prompt_chain("m", text)) & set(chat_chain("m", [{"role": "user", "content": text}]))
