"""The base struct every bus message derives from, and the one JSON codec they share."""

from __future__ import annotations

from typing import NewType, TypeVar, cast

import msgspec

T = TypeVar("T")

RequestId = NewType("RequestId", str)


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """A bus payload: immutable, keyword-only, strict about unknown fields, JSON on the wire.

    msgspec applies `kw_only` to the fields a class itself defines, so every message class repeats it.
    """


_encoder = msgspec.json.Encoder()
_decoders: dict[object, msgspec.json.Decoder] = {}


def encode(msg: object) -> bytes:
    """Encode a message (or any msgspec-encodable value) to JSON bytes."""
    return _encoder.encode(msg)


def decode(data: bytes | str, type_: type[T] | object) -> T:
    """Decode JSON bytes into `type_` (a class, or a Union of them: any type msgspec decodes), raising msgspec.ValidationError / DecodeError on bad input.

    Decoders are cached per type: building one costs more than decoding a small message. JSON nested deeper
    than msgspec recurses (a `[[[[...` in a field of any JSON) is a DecodeError too, not a RecursionError that
    every caller's `except (ValidationError, DecodeError)` would miss.
    """
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.json.Decoder(type_)
    try:
        return cast(T, dec.decode(data))  # the decoder of `type_` makes a `type_`: msgspec's types cannot say so
    except RecursionError:
        raise msgspec.DecodeError("JSON is nested too deeply") from None


def why_malformed(exc: BaseException, limit: int = 200) -> str:
    """The text of a decode error for a log line or an error reply, at most `limit` characters: msgspec names the
    field at fault, and a hostile message can make that name as long as the message."""
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
