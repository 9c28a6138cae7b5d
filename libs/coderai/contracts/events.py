"""Durable events on the EVENTS stream, one tagged union for the family."""

from __future__ import annotations

from typing import Union

from coderai.contracts.base import Message
from coderai.contracts.jobs import Op, RequestId


class RequestCompleted(Message, frozen=True, kw_only=True, tag="request.completed", tag_field="t"):
    """One API request finished, well or not. `status` is "ok" or the error code given to the client."""

    request_id: RequestId
    ts: float
    key_name: str
    model: str
    op: Op
    status: str
    http_status: int
    engine_id: str = ""
    node_id: str = ""
    duration_s: float = 0.0
    ttft_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stream: bool = False
    route_reason: str = ""
    cost_usd: float = 0.0


class ModelLoaded(Message, frozen=True, kw_only=True, tag="model.loaded", tag_field="t"):
    node_id: str
    engine_id: str
    model: str
    load_s: float
    ts: float


Event = Union[RequestCompleted, ModelLoaded]
