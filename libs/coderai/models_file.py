"""The models file: a TOML list of models the cluster should serve, read by the scheduler and `coderai up`.

    [[models]]
    name = "coderai-tiny"
    engine = "llama"
    path = "~/.coderai/models/coderai-tiny.gguf"
    params = { n_ctx = 2048 }

`load_models` parses and validates it (every failure a ModelsFileError naming the path); `write_models_file`
writes one from plain dicts (what `coderai up` does on first run, and what tests and benches do); `set_entry`
adds, replaces or removes one model in place, as the scheduler does when models change live.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from coderai.contracts import ModelConfig
from coderai.runtime.settings import SettingsError

__all__ = ["ModelsFileError", "entry", "load_models", "set_entry", "weights_problem", "write_models_file"]


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
    for m in models:
        why = weights_problem(m)
        if why:
            raise ModelsFileError(f"{path}: model {m.name!r}: {why}")
    return models


def weights_problem(m: ModelConfig) -> str:
    """What is wrong with where `m`'s weights come from (its `source`, `store_path`, `pod.volume`), or ""."""
    from coderai.catalog.source import SourceError, parse_source

    if not m.source:
        return "pod.volume keeps weights fetched by `source`, and it has none" if m.pod.volume else ""
    try:
        src = parse_source(m.source)
    except SourceError as exc:
        return f"source: {exc}"
    if src.kind == "store" and m.store_path:
        return 'both source = "store://..." and store_path name the head\'s store file: keep one'
    return ""


def write_models_file(path: Path, models: list[dict]) -> Path:
    """Write a scheduler models file from plain dicts (name, engine, path, params, nodes), atomically."""
    _replace_file(Path(path), "\n".join(_table(m) for m in models))
    return Path(path)


def entry(cfg: ModelConfig) -> dict[str, Any]:
    """`cfg` as a models-file table: only the fields that differ from their defaults, so it reads as written."""
    out: dict[str, Any] = {}
    for f in msgspec.structs.fields(cfg):
        value = getattr(cfg, f.name)
        default = (
            f.default
            if f.default is not msgspec.NODEFAULT
            else (f.default_factory() if f.default_factory is not msgspec.NODEFAULT else msgspec.NODEFAULT)
        )
        if value != default:
            out[f.name] = msgspec.to_builtins(value)
    return out


_HEADER = re.compile(r"^[ \t]*\[\[[ \t]*models[ \t]*\]\]", re.M)


def set_entry(path: str, name: str, table: dict[str, Any] | None) -> None:
    """Put `table` in place of model `name`'s entry (appended if it has none; `None` removes it), leaving every other
    entry as written, comments included; a file whose entries cannot be told apart in its text is rewritten from
    its parsed entries instead. ModelsFileError when the file does not parse, ValueError when TOML cannot hold a
    value of `table`."""
    p = Path(os.path.expanduser(path))
    text = p.read_text() if p.exists() else ""
    try:
        models = tomllib.loads(text).get("models", [])
    except tomllib.TOMLDecodeError as exc:
        raise ModelsFileError(f"{path}: {exc}") from None
    if table:
        want = [table if m.get("name") == name else m for m in models]
        if all(m.get("name") != name for m in models):
            want.append(table)
    else:
        want = [m for m in models if m.get("name") != name]
    out = _edited(text, name, table)
    try:
        ok = tomllib.loads(out).get("models", []) == want
    except tomllib.TOMLDecodeError:
        ok = False
    _replace_file(p, out if ok else "\n".join(_table(m) for m in want))


def _edited(text: str, name: str, table: dict[str, Any] | None) -> str:
    """`text` with the block of `name` (its `[[models]]` line up to the next one) swapped for `table`'s; the
    comments and blank lines that end the block stay (they may be the next entry's)."""
    new = _table(table) if table else ""
    starts = [m.start() for m in _HEADER.finditer(text)]
    for a, b in zip(starts, starts[1:] + [len(text)]):
        if _block_name(text[a:b]) == name:
            lines = text[a:b].splitlines(keepends=True)
            keep = len(lines)
            while keep and (not lines[keep - 1].strip() or lines[keep - 1].lstrip().startswith("#")):
                keep -= 1
            return text[:a] + new + "".join(lines[keep:]) + text[b:]
    sep = "" if not text or text.endswith("\n\n") else "\n" if text.endswith("\n") else "\n\n"
    return text + sep + new if new else text


def _block_name(block: str) -> str | None:
    try:
        [model] = tomllib.loads(block)["models"]
        return model.get("name")
    except (tomllib.TOMLDecodeError, KeyError, ValueError):
        return None


def _table(m: dict[str, Any]) -> str:
    return "\n".join(["[[models]]", *(f"{_key(k)} = {_toml(v)}" for k, v in m.items()), ""])


def _replace_file(path: Path, text: str) -> None:
    """Write through a temp file in the same folder and rename it over `path`: a reader sees the old file or the
    new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _key(k: str) -> str:
    """A TOML key: bare when it can be, else quoted (a dotted key would otherwise nest tables)."""
    return k if k and all(c.isalnum() or c in "_-" for c in k) else _toml(str(k))


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_toml(x)}" for k, x in v.items()) + " }" if v else "{}"
    if v is None:
        raise ValueError("TOML has no null: leave the field out instead")
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
