"""Read a GGUF file's header metadata without llama.cpp (the scheduler has no engine libraries)."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
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


def _skip(f: BinaryIO, item: int, n: int) -> None:
    """Step over `n` values of type `item` without decoding them (token lists and scores are most of a header)."""
    if item in _SCALARS:
        f.seek(n * struct.calcsize(_SCALARS[item]), os.SEEK_CUR)
    elif item == _STRING:
        for _ in range(n):
            f.seek(_read(f, "<Q"), os.SEEK_CUR)
    elif item == _ARRAY:
        for _ in range(n):
            inner, count = _read(f, "<I"), _read(f, "<Q")
            _skip(f, inner, count)
    else:
        raise ValueError(f"unknown GGUF value type {item}")


def _value(f: BinaryIO, kind: int, keep: bool) -> Any:
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, n = _read(f, "<I"), _read(f, "<Q")
        if not keep:  # arrays only when asked for by name
            _skip(f, item, n)
            return None
        return [_value(f, item, keep) for _ in range(n)]
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


SMALL_ARRAY = (
    4096  # number arrays up to this long are kept by `layout`: per-layer values (head_count_kv), not vocabularies
)


@dataclass(frozen=True)
class Layout:
    """What sizing needs of a GGUF: its scalars (and per-layer number arrays), every array's length (the token
    list's is the vocabulary), and where the tensor data starts (the file's size less that is the weights)."""

    meta: dict[str, Any]
    lengths: dict[str, int]
    data_offset: int
    parameters: int = 0  # the tensors' elements, summed


def layout(path: str | os.PathLike) -> Layout:
    """The header read to its end (key/values, then the tensor infos), never the tensor data."""
    meta: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _read(f, "<I")  # version
        n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
        for _ in range(n_kv):
            key, kind = _string(f), _read(f, "<I")
            if kind != _ARRAY:
                meta[key] = _value(f, kind, keep=False)
                continue
            item, n = _read(f, "<I"), _read(f, "<Q")
            lengths[key] = n
            if item in _SCALARS and n <= SMALL_ARRAY:
                fmt = _SCALARS[item]
                meta[key] = list(struct.unpack("<" + fmt[1] * n, f.read(n * struct.calcsize(fmt))))
            else:
                _skip(f, item, n)
        params = 0
        for _ in range(n_tensors):  # name, dims, type, offset
            f.seek(_read(f, "<Q"), os.SEEK_CUR)
            dims = _read(f, "<I")
            count = 1
            for d in struct.unpack(f"<{dims}Q", f.read(8 * dims)):
                count *= d
            params += count
            f.seek(4 + 8, os.SEEK_CUR)
        align = int(meta.get("general.alignment") or 32)
        end = f.tell()
    return Layout(meta=meta, lengths=lengths, data_offset=(end + align - 1) // align * align, parameters=params)


def block_count(path: str | os.PathLike) -> int:
    """How many transformer blocks (layers) the model has; 0 when the file cannot tell."""
    try:
        meta = metadata(path)
    except (OSError, ValueError):
        return 0
    arch = meta.get("general.architecture")
    value = meta.get(f"{arch}.block_count") if arch else None
    return int(value) if isinstance(value, int) else 0
