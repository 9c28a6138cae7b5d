"""Hypothesis strategies for bad input: malformed, truncated, oversized and wrong-typed messages made from a
msgspec type (the bus fuzz of tests/integration/test_bus_fuzz.py), and hostile JSON values for HTTP bodies
(tests/integration/test_http_abuse.py)."""

from __future__ import annotations

import base64
import json
import random
from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import strategies as st

from coderai.contracts.base import decode

# --- bus messages, from the msgspec types ----------------------------------------------------------------------

TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", " ", "..", "../../etc/passwd", "a.b", "*", ">", "w1", "tiny", "\x00", "é.*>", "x" * 300]),
)


def values(t: Any, depth: int = 0) -> st.SearchStrategy:
    """Well-typed JSON values of the msgspec type `t` (a `msgspec.inspect` type); constraints roughly kept."""
    if isinstance(t, mi.StructType):
        fields = {f.encode_name: f for f in t.fields}
        required = {n: values(f.type, depth + 1) for n, f in fields.items() if f.required}
        optional = {n: values(f.type, depth + 1) for n, f in fields.items() if not f.required} if depth < 2 else {}
        if t.tag is not None and t.tag_field is not None:  # msgspec sets both or neither
            required[t.tag_field] = st.just(t.tag)
        return st.fixed_dictionaries(required, optional=optional)
    if isinstance(t, mi.UnionType):
        return st.one_of([values(x, depth) for x in t.types])
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.EnumType):
        return st.sampled_from([m.value for m in t.cls])
    if isinstance(t, mi.StrType):
        lo, hi = t.min_length or 0, t.max_length if t.max_length is not None else 24
        return st.one_of(TEXT, st.text(min_size=lo, max_size=max(lo, min(hi, 24)))).filter(lambda s: lo <= len(s) <= hi)
    if isinstance(t, (mi.BytesType, mi.ByteArrayType)):
        return st.binary(max_size=16).map(lambda b: base64.b64encode(b).decode())
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.IntType):
        lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else None)
        hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else None)
        return st.one_of(
            st.integers(lo, hi).filter(lambda i: -(2**63) <= i < 2**63),
            st.sampled_from(
                [x for x in (0, -1, 2**31, 2**63 - 1) if (lo is None or x >= lo) and (hi is None or x <= hi)]
                or [lo or 0]
            ),
        )
    if isinstance(t, mi.FloatType):
        return st.floats(
            t.ge if t.ge is not None else t.gt,
            t.le if t.le is not None else t.lt,
            allow_nan=False,
            allow_infinity=False,
            exclude_min=t.gt is not None,
            exclude_max=t.lt is not None,
        )
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        return st.lists(values(t.item_type, depth + 1), min_size=t.min_length or 0, max_size=2 if depth < 3 else 0)
    if isinstance(t, mi.TupleType):
        return st.tuples(*(values(x, depth + 1) for x in t.item_types)).map(list)
    if isinstance(t, (mi.DictType,)):
        return st.dictionaries(
            values(t.key_type, depth + 1) if isinstance(t.key_type, mi.LiteralType) else TEXT,
            values(t.value_type, depth + 1),
            max_size=2 if depth < 3 else 0,
        )
    if isinstance(t, mi.DateTimeType):
        return st.datetimes().map(lambda d: d.isoformat())
    return st.one_of(st.none(), st.integers(-5, 5), TEXT)  # Any, Raw and the rest: any JSON


OTHER = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    TEXT,
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(TEXT, st.integers(), max_size=2),
)


def decodes(data: bytes, type_: Any) -> bool:
    """Whether `data` decodes as `type_` (a bad input must not)."""
    try:
        decode(data, type_)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return False
    return True


def to_json(value: Any) -> bytes:
    """JSON text of `value`, non-ASCII kept as is."""
    return json.dumps(value, ensure_ascii=False).encode()


def kinds(type_: Any) -> dict[str, st.SearchStrategy]:
    """Bad inputs for a subject carrying `type_`, by kind; every one of them fails to decode as `type_`."""
    info = mi.type_info(type_)
    valid = values(info)
    names = [f.encode_name for f in info.fields] if isinstance(info, mi.StructType) else []

    @st.composite
    def truncated(draw: Any) -> bytes:
        v = draw(valid)
        if draw(st.booleans()):
            try:
                return msgspec.msgpack.encode(v)  # a well-formed message in the other encoding
            except OverflowError:
                pass
        data = to_json(v)
        return data[: draw(st.integers(0, len(data) - 1))]

    @st.composite
    def wrong_type(draw: Any) -> bytes:
        v = draw(valid)
        how = draw(st.sampled_from(["field", "field", "field", "unknown", "top"] if names else ["unknown", "top"]))
        if how == "field" and isinstance(v, dict):
            v = {**v, draw(st.sampled_from(names)): draw(OTHER)}
        elif how == "unknown" and isinstance(v, dict):
            v = {**v, draw(TEXT.filter(lambda k: k not in names)): draw(OTHER)}
        else:
            v = draw(OTHER.filter(lambda o: not isinstance(o, dict)))
        return to_json(v)

    return {"bytes": st.binary(max_size=300), "truncated": truncated(), "wrong_type": wrong_type()}


def open_path(t: Any, depth: int = 0) -> bytes | None:
    """The JSON that leads into a place of type `t` where any JSON goes (`Any`, `Raw`), or None if there is none:
    bytes nested deeply there reach the decoder's recursion limit instead of failing at the first bracket."""
    if isinstance(t, (mi.AnyType, mi.RawType)):
        return b""
    if depth > 4:
        return None
    if isinstance(t, mi.StructType):
        for f in t.fields:
            if (inner := open_path(f.type, depth + 1)) is not None:
                tagged = t.tag is not None and t.tag_field is not None  # msgspec sets both or neither
                tag = b'"%s":%s,' % (str(t.tag_field).encode(), json.dumps(t.tag).encode()) if tagged else b""
                return b"{" + tag + json.dumps(f.encode_name).encode() + b":" + inner
        return None
    if isinstance(t, mi.UnionType):
        return next((p for x in t.types if (p := open_path(x, depth + 1)) is not None), None)
    if isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        inner = open_path(t.item_type, depth + 1)
        return None if inner is None else b"[" + inner
    if isinstance(t, mi.DictType):
        inner = open_path(t.value_type, depth + 1)
        return None if inner is None else b'{"k":' + inner
    return None


def oversized(size: int, how: str, seed: int, type_: Any) -> bytes:
    """A message of `size` bytes (the server's max_payload at most) that cannot decode."""
    rnd = random.Random(seed)
    if how == "random":
        return rnd.randbytes(size)
    if how == "key":  # an unknown field whose name is the whole message: its error text must not be
        return b'{"' + b"k" * (size - 6) + b'":1}'
    if how == "nested":  # deeper than any decoder recurses, where the type takes any JSON if it has such a place
        path = open_path(mi.type_info(type_)) or b""
        return path + b"[" * (size - len(path))
    return b'{"' + b"v" * (size - 3)  # a string that never ends


# --- HTTP bodies ------------------------------------------------------------------------------------------------

FIELDS = [
    "model",
    "messages",
    "prompt",
    "input",
    "max_tokens",
    "n",
    "stream",
    "stop",
    "temperature",
    "top_p",
    "seed",
    "tools",
    "tool_choice",
    "response_format",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "stream_options",
    "system",
    "instructions",
    "format",
    "options",
    "keep_alive",
    "documents",
    "query",
    "voice",
    "size",
    "previous_response_id",
    "max_output_tokens",
    "metadata",
    "thinking",
    "echo",
    "suffix",
    "user",
]

NASTY = st.sampled_from(
    [
        "",
        "\x00",
        "\ud800",
        "\udfff\ud800",
        "x" * 70_000,
        2**64,
        -(2**63) - 1,
        -0.0,
        1e308,
        float("nan"),
        float("inf"),
        [],
        {},
        [None],
        [[]],
        [{}],
        [{"role": 1}],
        [{"role": "user", "content": {"x": 1}}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}}]}],
        [{"role": "user", "content": [{"type": "nope"}]}],
        [{"role": "assistant", "tool_calls": "x"}],
        {"type": "json_schema", "json_schema": {"schema": 3}},
        [{"type": "function"}],
        {"num_predict": "x"},
    ]
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | NASTY,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), kids, max_size=4)
    ),
    max_leaves=8,
)


def dumps(obj: object) -> bytes:
    """JSON text as a careless client would write it (NaN and lone surrogates included)."""
    return json.dumps(obj).encode("utf-8", "surrogatepass")
