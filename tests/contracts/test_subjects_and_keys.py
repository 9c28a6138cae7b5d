from __future__ import annotations

import pytest

from coderai.contracts import ChatJob, ErrorReply, RouteDecision, RouteRequest, encode, model_key, model_name
from coderai.contracts.nodes import Heartbeat
from coderai.contracts.subjects import ENGINE_CHAT, HEARTBEAT, ROUTE_PICK, check_token

NAMES = [
    "llama3",
    "qwen2.5:7b-instruct",
    "org/model-name",
    "a_b",
    "a b",
    "ünïcödé-模型",
    "x.y.z",
    "*",
    ">",
    "-",
    "%41",
    "_41",
    "tab\tname",
    "emoji-🙂",
    "A" * 200,
]


@pytest.mark.parametrize("name", NAMES)
def test_model_key_round_trips_and_is_one_safe_token(name):
    key = model_key(name)
    assert model_name(key) == name
    check_token(key)
    assert all(c.isalnum() and c.isascii() or c in "-_" for c in key)


def test_model_key_is_injective_over_close_names():
    names = ["a.b", "a_b", "a-b", "a_2Eb", "a:b", "A.b"]
    assert len({model_key(n) for n in names}) == len(names)


@pytest.mark.parametrize("bad", ["", "a_2", "a_zz", "a_2e", "a_41", "a.b", "a b", "é"])
def test_model_name_rejects_what_model_key_cannot_make(bad):
    with pytest.raises(ValueError):
        model_name(bad)


def test_model_key_rejects_empty():
    with pytest.raises(ValueError):
        model_key("")


def test_subject_builds_parses_and_wildcards():
    assert ENGINE_CHAT(node_id="n1", engine_id="n1-m") == "coderai.engine.n1.n1-m.chat"
    assert ENGINE_CHAT.parse("coderai.engine.n1.n1-m.chat") == {"node_id": "n1", "engine_id": "n1-m"}
    assert HEARTBEAT.wildcard() == "coderai.hb.*"
    assert ROUTE_PICK() == "coderai.route.pick"


@pytest.mark.parametrize("bad", ["", "a.b", "a*", ">", "a b"])
def test_subject_rejects_tokens_that_change_its_shape(bad):
    with pytest.raises(ValueError):
        ENGINE_CHAT(node_id="n", engine_id=bad)


def test_subject_requires_exactly_its_placeholders():
    with pytest.raises(TypeError):
        ENGINE_CHAT()
    with pytest.raises(TypeError):
        ENGINE_CHAT(node_id="n", engine_id="e", extra="x")


def test_a_bound_subject_drops_messages_that_speak_for_another_sender():
    hb = Heartbeat(node_id="n1", version="0", seq=1, ts=1.0, host="h", capabilities=[])
    assert HEARTBEAT.bound_to("coderai.hb.n1", hb)
    assert not HEARTBEAT.bound_to("coderai.hb.n2", hb)  # n2 may publish there, but not as n1
    assert ENGINE_CHAT.bound_to("coderai.engine.x.y.chat", ChatJob(request_id="r", model="m", messages=[]))  # unbound


def test_subject_checks_the_message_type():
    with pytest.raises(TypeError):
        ROUTE_PICK.encode(ChatJob(request_id="r", model="m", messages=[]))
    assert ROUTE_PICK.decode(ROUTE_PICK.encode(RouteRequest(request_id="r", model="m", op="chat"))).model == "m"


def test_reply_decodes_to_reply_or_error():
    d = RouteDecision(engine_id="e", node_id="n", reason="least_busy")
    assert ROUTE_PICK.decode_reply(encode(d)) == d
    err = ErrorReply(code="no_engine", message="x")
    assert ROUTE_PICK.decode_reply(encode(err)) == err
