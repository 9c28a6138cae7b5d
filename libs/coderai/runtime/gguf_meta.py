"""Read a GGUF file's header metadata without llama.cpp (the scheduler has no engine libraries)."""

from __future__ import annotations

import os
import struct
from typing import Any, BinaryIO

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    return f.read(_read(f, "<Q")).decode("utf-8", "replace")


def _value(f: BinaryIO, kind: int, keep: bool) -> Any:
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, n = _read(f, "<I"), _read(f, "<Q")
        if item in _SCALARS and not keep:  # skip big arrays (token scores) without decoding them
            f.seek(n * struct.calcsize(_SCALARS[item]), os.SEEK_CUR)
            return None
        values = [_value(f, item, keep) for _ in range(n)]
        return values if keep else None  # arrays only when asked for by name
    raise ValueError(f"unknown GGUF value type {kind}")


def metadata(path: str | os.PathLike, keys: set[str] | None = None) -> dict[str, Any]:
    """The header's key/value pairs (only `keys` when given; arrays are skipped unless asked for by name)."""
    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _read(f, "<I")  # version
        _read(f, "<Q")  # tensor count
        for _ in range(_read(f, "<Q")):
            key = _string(f)
            wanted = keys is None or key in keys
            value = _value(f, _read(f, "<I"), keep=keys is not None and key in keys)
            if wanted:
                out[key] = value
            if keys is not None and keys <= out.keys():
                break
    return out


def block_count(path: str | os.PathLike) -> int:
    """How many transformer blocks (layers) the model has; 0 when the file cannot tell."""
    try:
        meta = metadata(path)
    except (OSError, ValueError):
        return 0
    arch = meta.get("general.architecture")
    value = meta.get(f"{arch}.block_count") if arch else None
    return int(value) if isinstance(value, int) else 0
