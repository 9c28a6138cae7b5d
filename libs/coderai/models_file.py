"""The models file: a TOML list of models the cluster should serve, read by the scheduler and `coderai up`.

    [[models]]
    name = "coderai-tiny"
    engine = "llama"
    path = "~/.coderai/models/coderai-tiny.gguf"
    params = { n_ctx = 2048 }

`load_models` parses and validates it (every failure a ModelsFileError naming the path); `write_models_file`
writes one from plain dicts (what `coderai up` does on first run, and what tests and benches do).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import msgspec

from coderai.contracts import ModelConfig
from coderai.runtime.settings import SettingsError

__all__ = ["ModelsFileError", "load_models", "write_models_file"]


class ModelsFileError(SettingsError):
    """The models file is unreadable or invalid; the message says where."""


class _File(msgspec.Struct, forbid_unknown_fields=True):
    models: list[ModelConfig] = []


def load_models(path: str) -> list[ModelConfig]:
    try:
        with open(os.path.expanduser(path), "rb") as fh:
            doc = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ModelsFileError(f"{path}: {exc}") from None
    try:
        models = msgspec.convert(doc, _File).models
    except msgspec.ValidationError as exc:
        raise ModelsFileError(f"{path}: {exc}") from None
    names = [m.name for m in models]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ModelsFileError(f"{path}: model names appear twice: {', '.join(dupes)}")
    return models


def write_models_file(path: Path, models: list[dict]) -> Path:
    """Write a scheduler models file from plain dicts (name, engine, path, params, nodes)."""
    lines: list[str] = []
    for m in models:
        lines.append("[[models]]")
        for k, v in m.items():
            if isinstance(v, dict):
                inner = ", ".join(f"{_key(ik)} = {_toml(iv)}" for ik, iv in v.items())
                lines.append(f"{k} = {{ {inner} }}")
            else:
                lines.append(f"{k} = {_toml(v)}")
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def _key(k: str) -> str:
    """A TOML key: bare when it can be, else quoted (a dotted key would otherwise nest tables)."""
    return k if k and all(c.isalnum() or c in "_-" for c in k) else _toml(str(k))


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
