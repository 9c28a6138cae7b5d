"""The keys file (coderai.accounts.keyfile): SHA-256 records in a private TOML file, read back exactly."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

from coderai.accounts import keyfile
from coderai.accounts.keyfile import KeyRecord, hash_key, load_keys, new_key, write_keys
from coderai.runtime.settings import SettingsError


def test_the_module_exports_the_keys_file_api():
    assert sorted(keyfile.__all__) == ["KeyRecord", "hash_key", "load_keys", "new_key", "write_keys"]


def test_new_keys_are_openai_shaped_and_unique():
    a, b = new_key(), new_key()
    assert a.startswith("sk-coderai-") and len(a) > len("sk-coderai-") + 32
    assert a != b


def test_hash_key_is_hex_sha256():
    assert hash_key("abc") == hashlib.sha256(b"abc").hexdigest()
    assert len(hash_key(new_key())) == 64


def test_a_record_defaults_to_the_inference_scope():
    assert KeyRecord("n", "h").scopes == ["inference"]


def test_write_then_load_round_trips_with_mode_0600(tmp_path):
    path = tmp_path / "keys.toml"
    recs = [
        KeyRecord("alice", hash_key("k1")),
        KeyRecord("ci", hash_key("k2"), ["inference", "admin"]),
        KeyRecord("none", hash_key("k3"), []),
    ]
    write_keys(str(path), recs)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_keys(str(path)) == {r.sha256: r for r in recs}


def test_write_keys_replaces_the_previous_contents_and_makes_the_file_private(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text("")
    os.chmod(path, 0o644)
    write_keys(str(path), [KeyRecord("a", hash_key("1")), KeyRecord("b", hash_key("2"))])
    write_keys(str(path), [KeyRecord("c", hash_key("3"))])
    assert [r.name for r in load_keys(str(path)).values()] == ["c"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    write_keys(str(path), [])
    assert load_keys(str(path)) == {}


def test_a_name_with_a_quote_round_trips(tmp_path):
    path = tmp_path / "keys.toml"
    write_keys(str(path), [KeyRecord('bob "the admin"', hash_key("1"))])
    assert [r.name for r in load_keys(str(path)).values()] == ['bob "the admin"']


def test_load_keys_lowercases_digests_and_expands_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "k.toml").write_text(f'[[keys]]\nname = "a"\nsha256 = "{hash_key("k").upper()}"\n')
    assert list(load_keys("~/k.toml")) == [hash_key("k")]


@pytest.mark.parametrize(
    "text",
    [
        "[[keys]\nname = ",  # not TOML
        '[[keys]]\nname = "a"\n',  # sha256 missing
        '[[keys]]\nname = "a"\nsha256 = "x"\nrole = "admin"\n',  # unknown field
        "keys = 3\n",  # wrong type
        "[other]\nx = 1\n",  # unknown table
    ],
)
def test_a_bad_file_is_a_settings_error_naming_the_variable_and_path(tmp_path, text):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(SettingsError) as ei:
        load_keys(str(path))
    assert str(ei.value).startswith(f"CODERAI_GATEWAY_API_KEYS_FILE={path}: ")


def test_a_missing_file_is_a_settings_error(tmp_path):
    path = tmp_path / "missing.toml"
    with pytest.raises(SettingsError) as ei:
        load_keys(str(path))
    assert f"CODERAI_GATEWAY_API_KEYS_FILE={path}" in str(ei.value)
