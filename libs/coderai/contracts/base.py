"""The base struct every bus message derives from, and the one JSON codec they share."""

from __future__ import annotations

from typing import Any, NewType, TypeVar

import msgspec

T = TypeVar("T")

RequestId = NewType("RequestId", str)


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """A bus payload: immutable, keyword-only, strict about unknown fields, JSON on the wire.

    msgspec applies `kw_only` to the fields a class itself defines, so every message class repeats it.
    """


_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder] = {}


def encode(msg: Any) -> bytes:
    """Encode a message (or any msgspec-encodable value) to JSON bytes."""
    return _encoder.encode(msg)


def decode(data: bytes | str, type_: type[T] | Any) -> T:
    """Decode JSON bytes into `type_`, raising msgspec.ValidationError / DecodeError on bad input.

    Decoders are cached per type: building one costs more than decoding a small message.
    """
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.json.Decoder(type_)
    return dec.decode(data)
