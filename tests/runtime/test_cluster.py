"""The cluster token's rules and the join handshake's proofs (pure), and the users block rendered from the member
registry. The same rules against a real nats-server and a real head: tests/security/."""

from __future__ import annotations

import json
import re
from urllib.parse import unquote, urlsplit

import pytest

from coderai.runtime import members
from coderai.runtime.cluster import (
    WeakToken,
    check_token,
    fingerprint,
    head_proof,
    join_password,
    new_token,
    node_proof,
    token_bits,
    user_of,
    welcome_proof,
    with_user,
    without_user,
)

TOKEN = new_token()


def test_a_new_token_has_256_bits_and_passes():
    t = new_token()
    assert token_bits(t) >= 250 and check_token(t) == t
    assert new_token() != t
    assert not any(new_token().startswith("-") for _ in range(2000))  # `--cluster-token -x...` reads as an option


@pytest.mark.parametrize("weak", ["", "s3cret", "coderai-test-token", "0123456789abcdef", "a" * 12])
def test_a_weak_token_is_refused_with_how_to_make_one(weak):
    with pytest.raises(WeakToken, match="coderai token new"):
        check_token(weak)


def test_hex_counts_four_bits_a_character():
    assert token_bits("ab" * 16) == 128
    check_token("0123456789abcdef" * 2)


def test_the_fingerprint_names_the_cluster_without_the_token():
    assert re.fullmatch(r"[0-9a-f]{24}", fingerprint(TOKEN))
    assert fingerprint(TOKEN) == fingerprint(TOKEN) != fingerprint(new_token())
    assert TOKEN not in fingerprint(TOKEN)


def test_proofs_bind_every_input():
    base = head_proof(TOKEN, "n1", "w" * 32, "h" * 32)
    assert base != head_proof(new_token(), "n1", "w" * 32, "h" * 32)
    assert base != head_proof(TOKEN, "n2", "w" * 32, "h" * 32)
    assert base != head_proof(TOKEN, "n1", "x" * 32, "h" * 32)
    assert base != head_proof(TOKEN, "n1", "w" * 32, "x" * 32)
    # the worker's answer is another function of the same nonces: a head proof cannot be replayed as one
    assert base != node_proof(TOKEN, "n1", "w" * 32, "h" * 32, "")
    assert node_proof(TOKEN, "n1", "w", "h", "$2b$hash1") != node_proof(TOKEN, "n1", "w", "h", "$2b$hash2")
    assert welcome_proof(TOKEN, "n1", "h", "node-n1", "") != welcome_proof(TOKEN, "n1", "h", "node-n2", "")


def test_the_join_password_is_no_other_credential():
    jp = join_password(TOKEN)
    assert TOKEN not in jp and jp == join_password(TOKEN) != join_password(new_token())


def test_urls_with_and_without_users():
    url = with_user("nats://10.0.0.5:4222", "node-a", "p@ss/word:")
    assert user_of(url) == ("node-a", "p@ss/word:")
    assert urlsplit(url).hostname == "10.0.0.5" and urlsplit(url).port == 4222
    assert without_user(url) == "nats://10.0.0.5:4222"
    assert user_of("nats://h:1") == ("", "")
    assert "p@ss" not in unquote(without_user(url))


# --- the users block ----------------------------------------------------------------------------------------


def users_of(config: str) -> dict[str, dict]:
    body = config[config.index("users = ") + len("users = ") : config.rindex("}")]
    return {u["user"]: u for u in json.loads(body)}


def test_the_registry_renders_one_user_per_identity():
    reg, service_password = members.new_registry(TOKEN)
    node_password = members.add_node(reg, "n1")
    users = users_of(members.render(reg))
    assert set(users) == {"service", "join", "node-n1"}
    import bcrypt

    assert bcrypt.checkpw(service_password.encode(), users["service"]["password"].encode())
    assert bcrypt.checkpw(node_password.encode(), users["node-n1"]["password"].encode())
    assert bcrypt.checkpw(join_password(TOKEN).encode(), users["join"]["password"].encode())
    assert "permissions" not in users["service"]
    assert service_password not in members.render(reg) and node_password not in members.render(reg)


def test_without_a_token_nobody_can_join():
    reg, _ = members.new_registry("")
    assert set(users_of(members.render(reg))) == {"service"}


def test_expired_pods_are_left_out():
    reg, _ = members.new_registry()
    reg.members["p1"] = members.Member(node_id="p1", kind="pod", password_hash="$2b$x", expires_at=100.0)
    assert "pod-p1" in users_of(members.render(reg, now=99.0))
    assert "pod-p1" not in users_of(members.render(reg, now=101.0))


def test_a_node_reaches_only_its_own_subjects():
    perms = members.node_permissions("n1")
    pub, sub = perms["publish"]["allow"], perms["subscribe"]["allow"]
    assert "coderai.hb.n1" in pub and not any(p.startswith("coderai.hb.") and p != "coderai.hb.n1" for p in pub)
    assert sub == ["coderai.engine.n1.>", "coderai.cmd.node.n1.>", "_N.n1.>"]
    assert not any(p.startswith("_INBOX") for p in pub + sub)
    assert not any(
        "PURGE" in p or p.startswith("coderai.cmd.scheduler") or p.startswith("coderai.cmd.broker") for p in pub
    )
    assert perms["allow_responses"]["max"] > 1
    assert not any(".WORK." in p and "CONSUMER" in p for p in pub)  # no model held: no fan-out parts


def test_a_node_pulls_only_the_parts_of_the_models_it_holds():
    from coderai.contracts import ModelConfig
    from coderai.contracts.work import work_consumers

    held = [ModelConfig(name="minilm", engine="embed", path="/m", ops=["embed"])]
    pub = members.node_permissions("n1", work_consumers(held))["publish"]["allow"]
    [c] = work_consumers(held)
    assert f"$JS.API.CONSUMER.MSG.NEXT.WORK.{c}" in pub and f"$JS.API.CONSUMER.INFO.WORK.{c}" in pub
    assert not [p for p in pub if p.startswith("$JS.API.CONSUMER.CREATE.WORK.")]  # the scheduler makes them
    assert [p for p in pub if ".WORK." in p and (p.endswith(".*") or p.endswith(".>"))] == [
        f"$JS.ACK.WORK.{c}.>"
    ]  # the acks of its own consumer's parts, nothing wider


def test_join_may_only_ask_to_join():
    perms = members.join_permissions()
    assert perms["publish"]["allow"] == ["coderai.join.hello", "coderai.join.prove"]
    assert perms["subscribe"]["allow"] == ["_JOIN.>"]
