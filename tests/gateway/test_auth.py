"""Bearer keys: checked by SHA-256 digest, scoped, and kept in a private TOML file."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

from coderai.gateway.auth import ANONYMOUS, Authenticator, Caller, KeyRecord, hash_key, load_keys, new_key, write_keys
from coderai.gateway.errors import ApiError
from coderai.runtime.settings import SettingsError

KEY = "sk-coderai-right"
ADMIN_KEY = "sk-coderai-admin"


@pytest.fixture
def auth() -> Authenticator:
    recs = [KeyRecord("alice", hash_key(KEY)), KeyRecord("root", hash_key(ADMIN_KEY), ["inference", "admin"])]
    return Authenticator({r.sha256: r for r in recs})


async def denied(auth: Authenticator, header: str | None, scope: str = "inference") -> ApiError:
    with pytest.raises(ApiError) as ei:
        await auth.check(header, scope)
    return ei.value


def test_new_keys_are_openai_shaped_and_unique():
    a, b = new_key(), new_key()
    assert a.startswith("sk-coderai-") and len(a) > len("sk-coderai-") + 32
    assert a != b


def test_hash_key_is_hex_sha256():
    assert hash_key("abc") == hashlib.sha256(b"abc").hexdigest()
    assert len(hash_key(new_key())) == 64


def test_a_record_defaults_to_the_inference_scope():
    assert KeyRecord("n", "h").scopes == ["inference"]


async def test_no_keys_means_everyone_is_anonymous_with_every_scope():
    a = Authenticator(None)
    assert await a.check(None) is ANONYMOUS
    assert await a.check("Bearer whatever", "admin") is ANONYMOUS
    assert ANONYMOUS == Caller("anonymous", frozenset({"inference", "admin"}))


async def test_an_empty_key_table_still_requires_a_key():
    err = await denied(Authenticator({}), "Bearer " + KEY)
    assert (err.status, err.code) == (401, "invalid_api_key")


@pytest.mark.parametrize("header", [None, "", "Basic abc", "Bearer", "sk-coderai-right", "Token " + KEY])
async def test_a_missing_or_non_bearer_header_is_401(auth, header):
    err = await denied(auth, header)
    assert (err.status, err.code, err.type) == (401, "invalid_api_key", "invalid_request_error")
    assert "Missing API key" in err.message


@pytest.mark.parametrize("header", ["Bearer sk-coderai-wrong", "Bearer ", "Bearer " + KEY.upper(), "Bearer " + KEY + "x"])
async def test_a_wrong_key_is_401(auth, header):
    err = await denied(auth, header)
    assert (err.status, err.code) == (401, "invalid_api_key")
    assert "Incorrect API key" in err.message


@pytest.mark.parametrize("header", ["Bearer " + KEY, "bearer " + KEY, "BEARER " + KEY, "Bearer   " + KEY + "  "])
async def test_the_right_key_returns_its_caller(auth, header):
    assert await auth.check(header) == Caller("alice", frozenset({"inference"}))


async def test_a_key_without_the_scope_is_403(auth):
    err = await denied(auth, "Bearer " + KEY, "admin")
    assert (err.status, err.code) == (403, "forbidden")
    assert "'admin'" in err.message


async def test_a_key_with_the_scope_passes(auth):
    assert await auth.check("Bearer " + ADMIN_KEY, "admin") == Caller("root", frozenset({"inference", "admin"}))
    assert (await auth.check("Bearer " + ADMIN_KEY)).key_name == "root"


async def test_write_then_load_round_trips_with_mode_0600(tmp_path):
    path = tmp_path / "keys.toml"
    recs = [KeyRecord("alice", hash_key(KEY)), KeyRecord("ci", hash_key("k2"), ["inference", "admin"]), KeyRecord("none", hash_key("k3"), [])]
    write_keys(str(path), recs)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    loaded = load_keys(str(path))
    assert loaded == {r.sha256: r for r in recs}
    auth = Authenticator(loaded)
    assert await auth.check("Bearer " + KEY) == Caller("alice", frozenset({"inference"}))
    assert (await auth.check("Bearer k2", "admin")).key_name == "ci"
    assert (await denied(auth, "Bearer k3")).status == 403


def test_write_keys_replaces_the_previous_contents(tmp_path):
    path = tmp_path / "keys.toml"
    write_keys(str(path), [KeyRecord("a", hash_key("1")), KeyRecord("b", hash_key("2"))])
    write_keys(str(path), [KeyRecord("c", hash_key("3"))])
    assert [r.name for r in load_keys(str(path)).values()] == ["c"]


def test_writing_no_records_loads_as_no_keys(tmp_path):
    path = tmp_path / "keys.toml"
    write_keys(str(path), [])
    assert load_keys(str(path)) == {}


def test_rewriting_an_existing_world_readable_file_makes_it_private(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text("")
    os.chmod(path, 0o644)
    write_keys(str(path), [KeyRecord("a", hash_key("1"))])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_name_with_a_quote_round_trips(tmp_path):
    path = tmp_path / "keys.toml"
    write_keys(str(path), [KeyRecord('bob "the admin"', hash_key("1"))])
    assert [r.name for r in load_keys(str(path)).values()] == ['bob "the admin"']


async def test_load_keys_lowercases_digests(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(f'[[keys]]\nname = "a"\nsha256 = "{hash_key(KEY).upper()}"\n')
    loaded = load_keys(str(path))
    assert list(loaded) == [hash_key(KEY)]
    assert (await Authenticator(loaded).check("Bearer " + KEY)).key_name == "a"


def test_load_keys_expands_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write_keys(str(tmp_path / "k.toml"), [KeyRecord("a", hash_key("1"))])
    assert [r.name for r in load_keys("~/k.toml").values()] == ["a"]


@pytest.mark.parametrize("text", [
    "[[keys]\nname = ",  # not TOML
    '[[keys]]\nname = "a"\n',  # sha256 missing
    '[[keys]]\nname = "a"\nsha256 = "x"\nrole = "admin"\n',  # unknown field
    'keys = 3\n',  # wrong type
    '[other]\nx = 1\n',  # unknown table
])
def test_load_keys_bad_file_is_a_settings_error_naming_the_variable_and_path(tmp_path, text):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(SettingsError) as ei:
        load_keys(str(path))
    assert str(ei.value).startswith(f"CODERAI_GATEWAY_API_KEYS_FILE={path}: ")


def test_load_keys_missing_file_is_a_settings_error(tmp_path):
    path = tmp_path / "missing.toml"
    with pytest.raises(SettingsError) as ei:
        load_keys(str(path))
    assert f"CODERAI_GATEWAY_API_KEYS_FILE={path}" in str(ei.value)
