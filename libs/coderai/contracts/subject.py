"""The `Subject` type: a subject pattern that knows the type it carries and the type its replies carry, so callers
and handlers that use the object cannot drift apart on a typo. The subjects themselves are declared in
`subjects.py` (and each op's engine subject with its op, in `ops.py`); this module sits below both."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Generic, Union

from typing_extensions import TypeVar

from coderai.contracts.base import decode, encode
from coderai.contracts.errors import ErrorReply

# both read only (`encode` checks its message at run time), so any subject is a Subject[object, object]; `Rep`
# defaults to object for a Subject[X] that leaves its replies untyped (a reply read from it must be narrowed)
Req = TypeVar("Req", covariant=True)
Rep = TypeVar("Rep", covariant=True, default=object)

_PLACEHOLDER = re.compile(r"\{(\w+)\}")
_BAD_TOKEN = re.compile(r"[.*>\s]")

PREFIX = "coderai"
_MADE_MAX = 4096  # concrete subjects one Subject keeps made


def check_token(value: str, what: str = "token") -> str:
    """Reject values that would change a subject's shape (dots, wildcards, whitespace) or are empty."""
    if not value or _BAD_TOKEN.search(value):
        raise ValueError(f"{what} {value!r} is not a valid subject token")
    return value


@dataclass(frozen=True)
class Subject(Generic[Req, Rep]):
    """A subject pattern such as `coderai.hb.{node_id}` with its request type and reply type (None: no reply).

    `request` and `reply` are classes or Unions of them (what msgspec decodes); a subject whose request or reply is a
    Union names its types in its declaration (`X: Subject[ChatJob, Frame] = ...`): a checker infers them from
    classes only."""

    pattern: str
    request: type[Req] | object
    reply: type[Rep] | object = None
    bind: tuple[str, ...] = ()
    """Placeholders that name the sender (e.g. `node_id`): NATS lets a node publish only under its own id, and a
    message whose field of that name says another id is dropped (`bound_to`), so no node speaks for another."""
    params: tuple[str, ...] = field(init=False)
    # made once, by __post_init__: the types a request may be, the reply's type (or an ErrorReply), and the concrete
    # subjects made so far (a few per engine; bounded, for subjects that name a job)
    _request_types: tuple[type, ...] = field(init=False, repr=False, compare=False)
    _reply_type: object = field(init=False, repr=False, compare=False)
    _made: dict[tuple[tuple[str, str], ...], str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(_PLACEHOLDER.findall(self.pattern)))
        # what every message on the hot path would otherwise build again
        object.__setattr__(self, "_request_types", _types(self.request))
        object.__setattr__(self, "_reply_type", Union[self.reply, ErrorReply])
        object.__setattr__(self, "_made", {})

    def __call__(self, **values: str) -> str:
        """The concrete subject; every placeholder must be given a valid token."""
        key = tuple(values.items())
        made = self._made.get(key)
        if made is not None:
            return made
        if set(values) != set(self.params):
            raise TypeError(f"{self.pattern} needs {self.params}, got {tuple(values)}")
        made = self.pattern.format(**{k: check_token(v, k) for k, v in values.items()})
        if len(self._made) >= _MADE_MAX:
            self._made.clear()
        self._made[key] = made
        return made

    def wildcard(self, **values: str) -> str:
        """A subscription subject: given placeholders filled in, the rest `*`."""
        filled = {p: check_token(values[p], p) if p in values else "*" for p in self.params}
        return self.pattern.format(**filled)

    def parse(self, subject: str) -> dict[str, str]:
        """The placeholder values of a concrete subject of this pattern."""
        regex = (
            "^"
            + _PLACEHOLDER.sub(r"(?P<\1>[^.]+)", re.escape(self.pattern).replace(r"\{", "{").replace(r"\}", "}"))
            + "$"
        )
        m = re.match(regex, subject)
        if not m:
            raise ValueError(f"{subject!r} does not match {self.pattern}")
        return m.groupdict()

    def bound_to(self, subject: str, msg: object) -> bool:
        """True when every bound placeholder of `subject` equals the same-named field of `msg`."""
        if not self.bind:
            return True
        try:
            values = self.parse(subject)
        except ValueError:
            return False
        return all(getattr(msg, name, None) == values.get(name) for name in self.bind)

    def encode(self, msg: object) -> bytes:
        if not isinstance(msg, self._request_types):
            raise TypeError(f"{self.pattern} carries {self.request}, not {type(msg).__name__}")
        return encode(msg)

    def decode(self, data: bytes) -> Req:
        return decode(data, self.request)

    def decode_reply(self, data: bytes) -> Rep | ErrorReply:
        """A reply of this subject: its reply type, or an ErrorReply."""
        return decode(data, self._reply_type)


def _types(t: object) -> tuple[type, ...]:
    args = getattr(t, "__args__", None)
    if args:
        return tuple(args)
    if not isinstance(t, type):
        raise TypeError(f"a subject carries a class or a Union of classes, not {t!r}")
    return (t,)
