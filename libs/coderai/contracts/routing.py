"""Gateway <-> router: where does this request go?"""

from __future__ import annotations

from typing import Literal

from coderai.contracts.base import Message
from coderai.contracts.jobs import Op, RequestId

RouteReason = Literal["pin", "session", "user", "prefix", "least_busy", "fallback"]


class RouteRequest(Message, frozen=True, kw_only=True):
    """Ask the router for an engine. `exclude` lists engines that already failed this request."""

    request_id: RequestId
    model: str
    op: Op
    affinity: list[str] = []
    exclude: list[str] = []


class RouteDecision(Message, frozen=True, kw_only=True, tag="route", tag_field="t"):
    engine_id: str
    node_id: str
    reason: RouteReason
