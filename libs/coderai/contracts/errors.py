"""The typed error every bus reply may carry instead of its normal payload."""

from __future__ import annotations

from typing import Literal

from coderai.contracts.base import Message

ErrorCode = Literal[
    "bad_request",  # the caller sent something the callee cannot accept
    "not_found",  # unknown model, engine or node
    "no_engine",  # nothing can serve this right now
    "engine_failed",  # the engine broke while serving
    "overloaded",  # try again later or elsewhere
    "busy",  # the engine's bounded queue is full: the client should slow down (429 with Retry-After)
    "over_budget",  # a spend cap (a model's pod budget, a global cap) would be exceeded
    "forbidden",  # the caller may not do this (a join without the token, a node speaking for another)
    "unavailable",  # the callee cannot do this here (e.g. a head without a member registry)
    "conflict",  # it exists already (a model added under a name that is taken)
    "stale_leader",  # sent under a singleton's lease that another head has won since (runtime/leader.py)
    "cancelled",  # the caller went away
    "timeout",
    "internal",
]


class ErrorReply(Message, frozen=True, kw_only=True, tag="error", tag_field="t"):
    """A failed reply. `retryable` tells the caller whether another engine or a later try may succeed."""

    code: ErrorCode
    message: str
    retryable: bool = False
    seq: int = 0
    param: str | None = None  # the request field at fault, for bad_request
    retry_after_s: float | None = None  # for busy: when a try is expected to be taken (the queue's expected wait)


class BusError(Exception):
    """Raised on the calling side when a bus reply was an ErrorReply, or no reply came."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        retryable: bool = False,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code: ErrorCode = code
        self.message = message
        self.retryable = retryable
        self.param = param
        self.retry_after_s = retry_after_s

    @classmethod
    def from_reply(cls, reply: ErrorReply) -> "BusError":
        """Lift an ErrorReply off the wire into an exception."""
        return cls(reply.code, reply.message, reply.retryable, reply.param, reply.retry_after_s)

    def to_reply(self, seq: int = 0) -> ErrorReply:
        """Put this error back on the wire."""
        return ErrorReply(
            code=self.code,
            message=self.message,
            retryable=self.retryable,
            seq=seq,
            param=self.param,
            retry_after_s=self.retry_after_s,
        )
