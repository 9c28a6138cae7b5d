"""Gateway <-> router: where does this request go?"""

from __future__ import annotations

from typing import Literal

from coderai.contracts.base import Message
from coderai.contracts.jobs import Op, RequestId

RouteReason = Literal["pin", "session", "user", "prefix", "least_busy", "fallback"]


class RouteRequest(Message, frozen=True, kw_only=True):
    """Ask the router for an engine.

    Affinity keys, strongest first: `session` (the `X-Session-Id` header), `user` (the OpenAI `user` field), then
    `prefix`, a chain of hashes over the conversation (h1 covers model, system and first user turn; each next
    element extends the previous by one message), or over fixed-size chunks of a completion prompt. All keys are
    opaque digests made by the gateway. `pin` is an admin's per-request pin (engine or node id). `exclude` lists
    engines that already failed this request.
    """

    request_id: RequestId
    model: str
    op: Op
    session: str = ""
    user: str = ""
    prefix: list[str] = []
    pin: str = ""
    exclude: list[str] = []


class RouteDecision(Message, frozen=True, kw_only=True, tag="route", tag_field="t"):
    """The engine to use and why (`fallback`: the pinned or affine engine could not take it). `holders`: how many
    live engines could have taken it (the gateway splits a fan-out request only over two or more)."""

    engine_id: str
    node_id: str
    reason: RouteReason
    holders: int = 1
    busy: bool = False  # every holder is at the model's `pod.busy_in_flight`: the gateway may escalate to a pod


class AffinityEntry(Message, frozen=True, kw_only=True):
    """A value in `coderai_affinity`: the engine a key last went to, and when (unix seconds)."""

    engine_id: str
    node_id: str
    ts: float
