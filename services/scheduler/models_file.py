"""The models file: a TOML list of models the cluster should serve.

    [[models]]
    name = "coderai-tiny"
    engine = "llama"
    path = "~/.coderai/models/coderai-tiny.gguf"
    params = { n_ctx = 2048 }
"""

from __future__ import annotations

import os
import tomllib

import msgspec

from coderai.contracts import ModelConfig
from coderai.runtime.settings import SettingsError


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
