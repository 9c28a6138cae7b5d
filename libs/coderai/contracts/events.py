"""Durable events on the EVENTS stream, one tagged union for the family."""

from __future__ import annotations

from typing import Literal, Union

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
    parts: int = 0  # fan-out: how many parts the request was split into (0: not split)
    client_request_id: str = ""  # the client's own id for the request (X-Client-Request-Id, a batch line's custom_id)


class ModelLoaded(Message, frozen=True, kw_only=True, tag="model.loaded", tag_field="t"):
    node_id: str
    engine_id: str
    model: str
    load_s: float
    ts: float


class ModelUnloaded(Message, frozen=True, kw_only=True, tag="model.unloaded", tag_field="t"):
    """The scheduler took a model off a node: `idle` (its keep_alive ran out), `evicted` (room for another),
    `removed` (the operator removed or changed it), `moved` (placement changed)."""

    node_id: str
    model: str
    reason: Literal["idle", "evicted", "removed", "moved"]
    ts: float


class ModelFetch(Message, frozen=True, kw_only=True, tag="model.fetch", tag_field="t"):
    """A node fetching a model's weights by its `source` (`coderai.evt.model.fetch.<node_id>`): `state` resolving,
    downloading, verifying (each file's sha256 against the Hub's), done, or failed with `error` (a checksum
    mismatch, a missing file, the Hub unreachable). Sent on each state or file change, each 10 %, and every few
    seconds between, so a pod's cold start can be watched and timed."""

    node_id: str
    model: str
    source: str
    state: Literal["resolving", "downloading", "verifying", "done", "failed"]
    file: str = ""
    bytes_done: int = 0
    bytes_total: int = 0
    rate_bps: float = 0.0
    error: str = ""
    ts: float = 0.0


class PartDone(Message, frozen=True, kw_only=True, tag="work.part", tag_field="t"):
    """A worker finished a fan-out part (`ok`), gave it back for another worker (`retry`), or answered it with
    an error once its deliveries ran out (`failed`); for the fan-out metrics (parts per worker, redeliveries)."""

    request_id: RequestId
    model: str
    op: Op
    part: int
    node_id: str
    engine_id: str
    status: Literal["ok", "failed", "retry"]
    deliveries: int = 1
    duration_s: float = 0.0
    ts: float = 0.0


class PodEvent(Message, frozen=True, kw_only=True, tag="pod", tag_field="t"):
    """`coderai.evt.pod.<what>`: created, ready, billed (with `seconds` and `usd`), stopped."""

    what: Literal["created", "ready", "billed", "stopped"]
    name: str
    model: str
    pod_id: str = ""
    gpu_type: str = ""
    hourly_usd: float = 0.0
    seconds: float = 0.0
    usd: float = 0.0
    reason: str = ""
    ts: float = 0.0


class EngineReady(Message, frozen=True, kw_only=True, tag="engine.ready", tag_field="t"):
    """A router can route to an engine it could not before (`coderai.evt.engine.ready.<model_key>`): a ready engine
    entered its table from a heartbeat or an assignment. A request waiting for a model being loaded on demand or a
    pod being rented asks the router again on it, not on a timer. Each router publishes its own."""

    model: str
    engine_id: str
    node_id: str
    ts: float = 0.0


Event = Union[RequestCompleted, ModelLoaded, ModelUnloaded, ModelFetch, PartDone, PodEvent, EngineReady]
