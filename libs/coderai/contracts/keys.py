"""A reversible, subject-safe encoding of model names.

A NATS subject token may not hold `.`, `*`, `>` or whitespace, and model names are full of dots
("qwen2.5-7b") and colons ("llama3:8b"). Letters, digits and `-` pass through; every other byte of the
UTF-8 name becomes `_XX` (upper-case hex), so `_` itself is escaped and decoding is unambiguous.
"""

from __future__ import annotations

import string

_SAFE = frozenset((string.ascii_letters + string.digits + "-").encode())


def model_key(name: str) -> str:
    """Encode a model name into a single subject token; `model_name` reverses it."""
    if not name:
        raise ValueError("model name must not be empty")
    out: list[str] = []
    for b in name.encode("utf-8"):
        out.append(chr(b) if b in _SAFE else f"_{b:02X}")
    return "".join(out)


def model_name(key: str) -> str:
    """Decode a token made by `model_key`; raises ValueError on anything it could not have made."""
    raw = bytearray()
    i = 0
    while i < len(key):
        c = key[i]
        if c == "_":
            hex_ = key[i + 1 : i + 3]
            if len(hex_) != 2 or hex_.upper() != hex_ or any(h not in string.hexdigits for h in hex_):
                raise ValueError(f"bad escape at {i} in model key {key!r}")
            b = int(hex_, 16)
            if b in _SAFE:
                raise ValueError(f"needless escape at {i} in model key {key!r}")
            raw.append(b)
            i += 3
        elif ord(c) < 128 and ord(c) in _SAFE:
            raw.append(ord(c))
            i += 1
        else:
            raise ValueError(f"character {c!r} cannot appear in a model key")
    if not raw:
        raise ValueError("empty model key")
    return raw.decode("utf-8")
