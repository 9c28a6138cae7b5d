"""Service settings: one frozen struct per service, read from `CODERAI_*` env vars and an optional TOML file.

For a field `port` of the gateway, the value comes from `CODERAI_GATEWAY_PORT`, else `CODERAI_PORT` (shared
names such as `CODERAI_NATS_URL` serve every service), else the `[gateway]` table of the TOML file named by
`CODERAI_CONFIG`, else that file's top level, else the default. A secret or a URL may instead be in a file that
`CODERAI_..._FILE` names, at the same place in that order (`file_settable`). A bad value fails at start with the
name of the variable (or TOML key) that held it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec

S = TypeVar("S", bound=msgspec.Struct)


class SettingsError(Exception):
    """A setting is missing or malformed; the message names the variable to fix."""


class CommonSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings every service has."""

    nats_url: str = ""  # empty: nats://127.0.0.1:4222, or (a worker with a cluster token) the head found by mDNS
    nats_password_file: str = ""  # a file holding the `service` user's NATS password (the head makes it)
    nats_ca: str = ""  # the CA (PEM text, or a file) NATS' certificate must be signed by; set: connect with TLS
    cluster_token: str = ""  # the shared secret a worker joins with (runtime/cluster.py); no credential comes from it
    nats_replicas: int = 1  # JetStream copies of every stream and bucket made or found with fewer: min(3, heads)
    node_id: str = ""
    log_level: str = "INFO"
    log_format: str = "auto"  # auto: JSON off a terminal, text on one
    data_dir: str = "~/.coderai"
    # Redis key prefix of pod money (accounts/pod_money.py): the pod-broker writes reservations, spend and the
    # ledger there; the gateway (GET /admin/spend) and metrics read them. One value for all of them
    pod_ledger_prefix: str = "coderai:pods"


def _parse_env(raw: str, annotation: Any) -> Any:
    """Env values are strings; lists and dicts may be written as JSON or (lists) comma-separated."""
    text = raw.strip()
    origin = getattr(annotation, "__origin__", annotation)
    if origin in (list, tuple, set, frozenset) or "list" in str(annotation):
        if text.startswith("["):
            return json.loads(text)
        return [p.strip() for p in text.split(",") if p.strip()]
    if origin is dict or "dict" in str(annotation):
        return json.loads(text)
    return raw


def load_settings(cls: type[S], service: str, env: Mapping[str, str] | None = None, **overrides: Any) -> S:
    """Build `cls` for `service` from overrides > env > TOML file > defaults."""
    env = os.environ if env is None else env
    svc = service.upper().replace("-", "_")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    config_path = env.get("CODERAI_CONFIG")
    if config_path:
        try:
            with open(os.path.expanduser(config_path), "rb") as fh:
                doc = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SettingsError(f"CODERAI_CONFIG={config_path}: {exc}") from None
        section = doc.get(service.replace("-", "_"), {}) or doc.get(service, {})
        for name in cls.__struct_fields__:
            if name in section:
                values[name], sources[name] = section[name], f"{config_path} [{service}] {name}"
            elif name in doc and not isinstance(doc[name], dict):
                values[name], sources[name] = doc[name], f"{config_path} {name}"

    hints = {f.name: f.type for f in msgspec.structs.fields(cls)}
    for name in cls.__struct_fields__:
        from_file = file_settable(cls, name)
        for var in (f"CODERAI_{svc}_{name.upper()}", f"CODERAI_{name.upper()}"):
            if from_file and env.get(var + "_FILE"):
                values[name], sources[name] = env_or_file(var, env), var + "_FILE"
                break
            if var in env:
                try:
                    values[name] = _parse_env(env[var], hints[name])
                except ValueError as exc:
                    raise SettingsError(f"{var}: {exc}") from None
                sources[name] = var
                break

    for name, value in overrides.items():
        if value is not None:
            values[name], sources[name] = value, f"--{name.replace('_', '-')}"

    try:
        return msgspec.convert(values, cls, strict=False)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        field = msg.rsplit("$.", 1)[-1].rstrip("`").split("[")[0].split(".")[0] if "$." in msg else ""
        where = sources.get(field, f"CODERAI_{svc}_{field.upper()}" if field else "settings")
        raise SettingsError(f"{where}: {msg}") from None


SECRET_WORDS = ("token", "secret", "password", "key_hash", "api_key", "apikey", "passphrase")


def file_settable(cls: type[msgspec.Struct], name: str) -> bool:
    """Whether field `name` may also be read from a file: `CODERAI_..._FILE` naming a file that holds the value, as
    Docker's and systemd's secrets are handed over (a value in the environment is printed by `docker inspect` and
    read from /proc by the same user). Text fields that hold a secret or a URL (which may carry a password), and
    only where no field of that name with `_file` exists already (`nats_password_file` is a path itself)."""
    field = next((f for f in msgspec.structs.fields(cls) if f.name == name), None)
    if field is None or field.type is not str or f"{name}_file" in cls.__struct_fields__ or name.endswith("_file"):
        return False
    return name.endswith("_url") or any(word in name for word in SECRET_WORDS)


def env_or_file(var: str, env: Mapping[str, str] | None = None) -> str:
    """The value of `var`, or of the file `var`_FILE names (for what reads a secret outside a settings struct:
    `coderai up`'s and `coderai-init`'s cluster token); "" when neither is set. Both set, or a file that cannot be
    read or is empty, is a SettingsError naming the variable. An empty `var`_FILE is as if unset (what compose's
    `${X:+...}` gives when X is not set)."""
    env = os.environ if env is None else env
    if env.get(var + "_FILE"):
        if var in env:
            raise SettingsError(f"{var} and {var}_FILE are both set: set one of them")
        return _read_value_file(var + "_FILE", env[var + "_FILE"])
    return env.get(var, "")


def _read_value_file(var: str, path: str) -> str:
    """The value in the file `var` names, without the line end an editor or `echo` leaves; unreadable or empty is a
    SettingsError naming `var` (never the value)."""
    try:
        value = Path(os.path.expanduser(path)).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{var}={path}: {exc.strerror if isinstance(exc, OSError) else exc}") from None
    if not value:
        raise SettingsError(f"{var}={path}: the file is empty")
    return value


def _mask_url(value: str) -> str:
    """`value` with the password of each URL in it masked: one URL, several comma-separated ones (a NATS URL listing
    every head, each with its credentials), or one URL over several hosts (`redis+sentinel://:pw@a:1,b:2/m`)."""
    from coderai.runtime.redis_client import mask

    return ",".join(mask(part) for part in _urls(value))


def _urls(value: str) -> list[str]:
    return value.split(",") if value.count("://") > 1 else [value]


def _url_secrets(value: str) -> list[str]:
    """The passwords in `value`'s URLs (user info, and query parameters named like a password), as given and
    unquoted."""
    from urllib.parse import parse_qsl, unquote, urlsplit

    found = []
    for part in _urls(value):
        with contextlib.suppress(ValueError):
            split = urlsplit(part)
            found += [split.password] if split.password else []
            found += [v for k, v in parse_qsl(split.query) if "password" in k.lower() and v]
    return [x for p in found for x in (p, unquote(p))]


def describe(settings: msgspec.Struct) -> dict[str, Any]:
    """Settings as a dict for the start-up log line, secrets masked: secret-named fields and the passwords in
    URLs. Each masked value is also registered with the log formatter, so no later line prints it either."""
    from coderai.runtime.logging import add_secret

    out = msgspec.structs.asdict(settings)
    for k, v in out.items():
        if isinstance(v, str) and v and any(s in k.lower() for s in SECRET_WORDS):
            add_secret(v)
            out[k] = "***"
        elif isinstance(v, str) and "://" in v:
            for secret in _url_secrets(v):
                add_secret(secret)
            out[k] = _mask_url(v)
    return out
