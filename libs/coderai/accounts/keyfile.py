"""The keys file: bootstrap API keys as SHA-256 hashes in a private TOML file of `[[keys]]` tables.

    [[keys]]
    name = "admin"
    sha256 = "<hex digest of the key>"
    scopes = ["inference", "admin"]

`coderai up` and docker/head_init.py write it (through coderai.up.ensure_api_key); the gateway reads it at start
(`--api-keys-file`, CODERAI_GATEWAY_API_KEYS_FILE). Keys themselves are never stored in clear. Keys made later
with `coderai keys` live in Redis instead (accounts/keys.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tomllib

import msgspec

from coderai.runtime.settings import SettingsError

__all__ = ["KeyRecord", "new_key", "hash_key", "load_keys", "write_keys"]


class KeyRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    sha256: str
    scopes: list[str] = msgspec.field(default_factory=lambda: ["inference"])


class _KeysFile(msgspec.Struct, forbid_unknown_fields=True):
    keys: list[KeyRecord] = []


def new_key() -> str:
    """A fresh API key in the OpenAI shape (`sk-...`)."""
    return "sk-coderai-" + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_keys(path: str) -> dict[str, KeyRecord]:
    """Hash -> record, from a TOML file of `[[keys]]` tables."""
    try:
        with open(os.path.expanduser(path), "rb") as fh:
            doc = msgspec.convert(tomllib.load(fh), _KeysFile)
    except (OSError, tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
        raise SettingsError(f"CODERAI_GATEWAY_API_KEYS_FILE={path}: {exc}") from None
    return {k.sha256.lower(): k for k in doc.keys}


def write_keys(path: str, records: list[KeyRecord]) -> None:
    """Write the keys file, readable by its owner only (also when it existed before with wider rights)."""
    lines = []
    for r in records:
        # JSON string escaping is valid TOML basic-string escaping
        scopes = ", ".join(json.dumps(s) for s in r.scopes)
        lines += [
            "[[keys]]",
            f"name = {json.dumps(r.name)}",
            f"sha256 = {json.dumps(r.sha256)}",
            f"scopes = [{scopes}]",
            "",
        ]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines))
