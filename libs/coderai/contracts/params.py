"""The kinds a family's params may have, with their ranges: the vocabulary of each family's `params` table
(`families.py`). The checks that read them are `coderai.engine_params`."""

from __future__ import annotations

from dataclasses import dataclass

EXEC_PARAMS = frozenset({"python", "env", "extra_args", "trust_remote_code"})
"""Params that choose a program, its environment or arguments, or run a repository's code: the operator's only."""

MAX_TEXT = 4096  # a string param's length at most (a path, a name, a list of numbers)
MAX_TEMPLATE = 65536  # a chat template's (an inline Jinja template)
MAX_NESTED = 16384  # a list or table param's encoded size at most (echo's tool script, rapidocr's options)


@dataclass(frozen=True)
class P:
    """One param: its kind (int, float, bool, str, path, choice, list, table, int_or_bool), range and choices."""

    kind: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str | int | float | bool, ...] = ()
    size: int = MAX_TEXT


def whole(lo: float, hi: float) -> P:
    return P("int", lo, hi)


def num(lo: float, hi: float) -> P:
    return P("float", lo, hi)


def choice(*choices: str | int | float | bool) -> P:
    return P("choice", choices=choices)


BOOL = P("bool")
PATH = P("path")
THREADS = whole(1, 1024)
DEVICE = P("str")  # cpu, cuda, cuda:1, mps
TIMEOUT = num(1, 86_400)
TORCH_DTYPE = choice("float32", "float16", "bfloat16", "auto")
CTX = whole(16, 1 << 24)
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
ENV = P("table", size=MAX_NESTED)
ARGS = P("list", size=MAX_NESTED)


# --- reading a value ------------------------------------------------------------------------------------------------
# The engines read a param as int(), float() or str() of its value: these do the same conversion, and name the param
# in the error when a value is not of the kind (a list where a number belongs, a word where a number belongs).


def as_int(value: object, what: str) -> int:
    """int() of `value`: a number (a float is truncated, a bool is 0 or 1) or a numeric string; else a TypeError or
    ValueError naming `what`."""
    if not isinstance(value, (int, float, str)):
        raise TypeError(f"{what} must be a whole number, not {_shown(value)}")
    try:
        return int(value)
    except (ValueError, OverflowError):
        raise ValueError(f"{what} must be a whole number, not {_shown(value)}") from None


def as_float(value: object, what: str) -> float:
    """float() of `value`: a number (a bool is 0.0 or 1.0) or a numeric string; else a TypeError or ValueError
    naming `what`."""
    if not isinstance(value, (int, float, str)):
        raise TypeError(f"{what} must be a number, not {_shown(value)}")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{what} must be a number, not {_shown(value)}") from None


def as_str(value: object, what: str) -> str:
    """`value`, a string; else a TypeError naming `what`."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, not {_shown(value)}")
    return value


def as_strs(value: object, what: str) -> list[str]:
    """`value`, a list of strings; else a TypeError naming `what`."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{what} must be a list of strings, not {_shown(value)}")
    return [v for v in value if isinstance(v, str)]


def as_table(value: object, what: str) -> dict[str, object]:
    """`value`, a table (a JSON object: string keys); else a TypeError naming `what`."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"{what} must be a table, not {_shown(value)}")
    return {str(k): v for k, v in value.items()}


def _shown(value: object) -> str:
    return f"{type(value).__name__} {str(value)[:80]!r}"
