"""What the cluster token derives: an mDNS fingerprint, per-role NATS credentials, and nats-server's auth block."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from urllib.parse import quote, unquote, urlsplit

import pytest

from coderai.runtime.cluster import credentials, fingerprint, nats_auth_config, with_credentials

TOKEN = "correct horse battery staple"


def users_of(config: str) -> list[dict]:
    """The JSON array after `users = `, up to the block's final `}`."""
    body = config[config.index("users = ") + len("users = "):config.rindex("}")]
    return json.loads(body)


# --- fingerprint ------------------------------------------------------------------------------------


def test_fingerprint_is_24_lowercase_hex_digits():
    assert re.fullmatch(r"[0-9a-f]{24}", fingerprint(TOKEN))


def test_fingerprint_is_the_hmac_of_the_membership_context():
    expected = hmac.new(TOKEN.encode(), b"coderai-cluster-membership-v1", hashlib.sha256).hexdigest()[:24]
    assert fingerprint(TOKEN) == expected


def test_fingerprint_is_deterministic_and_differs_per_token():
    assert fingerprint(TOKEN) == fingerprint(TOKEN)
    assert fingerprint(TOKEN) != fingerprint(TOKEN + "!")
    assert fingerprint("a") != fingerprint("b")


def test_fingerprint_never_contains_the_token():
    for token in ["abc", "0123456789abcdef", fingerprint("seed")[:8]]:
        assert token not in fingerprint(token)


# --- credentials ------------------------------------------------------------------------------------


def test_user_is_the_role():
    assert credentials(TOKEN, "service")[0] == "service"
    assert credentials(TOKEN, "node")[0] == "node"


def test_passwords_differ_per_role_and_per_token():
    passwords = {credentials(t, r)[1] for t in [TOKEN, "other"] for r in ["service", "node"]}
    assert len(passwords) == 4


def test_credentials_are_deterministic_and_hide_the_token():
    assert credentials(TOKEN, "node") == credentials(TOKEN, "node")
    assert TOKEN not in credentials(TOKEN, "node")[1]


@pytest.mark.parametrize("role", ["admin", "", "Node", "services"])
def test_unknown_roles_are_refused(role):
    with pytest.raises(ValueError, match="role"):
        credentials(TOKEN, role)


# --- with_credentials -------------------------------------------------------------------------------


def test_credentials_go_into_a_url_with_a_port():
    user, password = credentials(TOKEN, "node")
    url = with_credentials("nats://10.0.0.5:4222", TOKEN, "node")
    parts = urlsplit(url)
    assert parts.scheme == "nats"
    assert (parts.hostname, parts.port) == ("10.0.0.5", 4222)
    assert (unquote(parts.username), unquote(parts.password)) == (user, password)


def test_credentials_go_into_a_url_without_a_port():
    url = with_credentials("nats://head.local", TOKEN, "service")
    parts = urlsplit(url)
    assert (parts.hostname, parts.port) == ("head.local", None)
    assert (parts.username, parts.password) == credentials(TOKEN, "service")


def test_the_scheme_is_kept():
    assert with_credentials("tls://head:4443", TOKEN, "node").startswith("tls://node:")


def test_an_empty_token_leaves_the_url_alone():
    assert with_credentials("nats://127.0.0.1:4222", "", "node") == "nats://127.0.0.1:4222"


def test_the_password_needs_no_escaping_in_a_url():
    for token in [TOKEN, "p@ss:w/rd?#%", "ü"]:
        _, password = credentials(token, "node")
        assert quote(password, safe="") == password
        assert urlsplit(with_credentials("nats://h:1", token, "node")).password == password


def test_the_token_never_appears_in_the_url():
    assert TOKEN not in unquote(with_credentials("nats://h:1", TOKEN, "node"))


# --- nats_auth_config -------------------------------------------------------------------------------


def test_the_config_is_an_authorization_block_with_both_users():
    config = nats_auth_config(TOKEN)
    assert config.startswith("authorization {")
    users = {u["user"]: u for u in users_of(config)}
    assert set(users) == {"service", "node"}
    for role in ["service", "node"]:
        assert users[role]["password"] == credentials(TOKEN, role)[1]


def test_the_service_user_has_full_rights():
    users = {u["user"]: u for u in users_of(nats_auth_config(TOKEN))}
    assert "permissions" not in users["service"]


def test_the_node_user_has_allow_lists():
    node = {u["user"]: u for u in users_of(nats_auth_config(TOKEN))}["node"]
    publish = node["permissions"]["publish"]["allow"]
    subscribe = node["permissions"]["subscribe"]["allow"]
    assert publish and subscribe
    assert "coderai.hb.*" in publish
    assert "coderai.route.pick" not in publish
    assert not any(s.startswith("coderai.route") for s in publish)
    assert not any(s.startswith("$KV.") for s in publish)  # a node reads its assignment, never writes one
    assert "_INBOX.>" in subscribe


def test_the_token_never_appears_in_the_config():
    for token in [TOKEN, "short", "x" * 40]:
        assert token not in nats_auth_config(token)


def test_the_config_differs_per_token():
    assert nats_auth_config("a") != nats_auth_config("b")
