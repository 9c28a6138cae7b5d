"""Turning a pulled model into a models-file entry, and appending it to the file the scheduler reads.

A running scheduler notices the appended entry within a second (`scheduler/live_models.py`), and `coderai models
pull --place` also asks it to serve the model at once; with no stack running, it is served when the stack starts.
"""

from __future__ import annotations

import os
import posixpath
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from coderai.catalog.errors import CatalogError
from coderai.catalog.store import ModelStore, Pulled


def model_entry(rec: Pulled, store: ModelStore) -> dict[str, Any]:
    """The `[[models]]` table for `rec`: name, engine, path, params, and memory_mb when the catalogue knows it.

    It also gets `store_path`, relative to the store, so a node that lacks `path` fetches the model from the head
    (see `store_location`).
    """
    from coderai.contracts import ModelConfig

    entry: dict[str, Any] = {"name": rec.name, "engine": rec.engine, "path": str(store.model_path(rec))}
    entry.update(store_location(rec))
    if rec.params:
        entry["params"] = dict(rec.params)
    if rec.memory_mb:
        entry["memory_mb"] = rec.memory_mb
    try:
        msgspec.convert(entry, ModelConfig)
    except msgspec.ValidationError as exc:
        raise CatalogError(f"{rec.name} does not make a valid model entry: {exc}") from None
    return entry


def store_location(rec: Pulled) -> dict[str, str]:
    """`store_path` (and `store_file`) of a pulled model: a single file (a GGUF) is named itself; a model that is
    the repo folder (whisper, embeddings, diffusers) is that folder, "<repo>/"; a main file among others (piper's
    .onnx beside its .onnx.json) is the smallest folder holding them all plus the main file's path inside it."""
    if rec.main and set(rec.files) <= {rec.main}:
        return {"store_path": f"{rec.repo}/{rec.main}"}
    if not rec.main:
        return {"store_path": f"{rec.repo}/"}
    common = posixpath.commonpath([posixpath.dirname(f) for f in {*rec.files, rec.main}])
    if not common:
        return {"store_path": f"{rec.repo}/", "store_file": rec.main}
    return {"store_path": f"{rec.repo}/{common}/", "store_file": posixpath.relpath(rec.main, common)}


def append_model(models_file: str | os.PathLike[str], entry: dict[str, Any]) -> Path:
    """Append `entry` to the models file (made if missing); a model of the same name already there is an error."""
    path = Path(os.path.expanduser(str(models_file)))
    text = path.read_text() if path.exists() else ""
    try:
        have = [m.get("name") for m in tomllib.loads(text).get("models", [])]
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"{path}: {exc}; fix it before adding models") from None
    if entry["name"] in have:
        raise CatalogError(f"{path} already serves a model named {entry['name']!r}; pull with --name to add another")
    block = ["[[models]]"]
    for k, v in entry.items():
        block.append(f"{k} = {_toml(v)}")
    sep = "" if not text or text.endswith("\n\n") else ("\n" if text.endswith("\n") else "\n\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + sep + "\n".join(block) + "\n")
    return path


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_toml(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _toml(k)
