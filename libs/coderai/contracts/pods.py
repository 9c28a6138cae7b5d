"""Escalation to rented pods: scheduler and pod-broker commands, what the broker tracks, and its events."""

from __future__ import annotations

from typing import Literal

from coderai.contracts.base import Message

PodState = Literal["creating", "booting", "ready", "stopping", "terminated", "failed", "preempted"]
LIVE_POD: frozenset[PodState] = frozenset({"creating", "booting", "ready", "stopping"})
"""A pod in these states may serve the model it was rented for (and fetch its files)."""


class BrokerStatusRequest(Message, frozen=True, kw_only=True):
    pass


class PodInfo(Message, frozen=True, kw_only=True):
    """A pod the broker rents, as kept in `coderai_pods` (by name). `node_id` is the name: the pod's worker
    heartbeats under it. `spot`: rented interruptible at the spot bid; `preempted`: RunPod took such a pod back."""

    name: str
    model: str
    state: PodState
    pod_id: str = ""
    gpu_type: str = ""
    gpu_count: int = 1
    spot: bool = False
    hourly_usd: float = 0.0
    created_at: float = 0.0
    ready_at: float = 0.0
    ended_at: float = 0.0
    last_busy_at: float = 0.0
    reserved_usd: float = 0.0
    cost_usd: float = 0.0  # live while it runs, final once billed
    error: str = ""
    # a RunPod serverless endpoint's id: this record is the broker's relay to it, no rented pod (docs/pods.md);
    # its requests are billed one by one, `cost_usd` is their sum
    serverless: str = ""


class BrokerStatus(Message, frozen=True, kw_only=True, tag="broker.status", tag_field="t"):
    """`configured`: the broker has all it needs (a RunPod API key, Redis for the ledger, a NATS URL for pods, a
    global hourly cap), so escalation to pods is possible; else `why` says what is missing. `outage`: RunPod's API
    is failing (since when, and how), so nothing is rented until it answers again; empty while it answers."""

    configured: bool
    pods: list[PodInfo] = []
    spent_usd: float = 0.0
    why: str = ""
    outage: str = ""


class EscalateRequest(Message, frozen=True, kw_only=True):
    """The gateway found no engine (`no_engine`) or only busy ones (`busy`) for `model`."""

    model: str
    reason: Literal["no_engine", "busy"]
    keep_alive_s: float | None = None  # the request's keep_alive, for a model loaded on demand


class EscalateReply(Message, frozen=True, kw_only=True, tag="escalate", tag_field="t"):
    """`acquiring`: a pod is on its way, `loading`: a node loads it on demand (wait and route again); `ready`: one serves it now; `refused`: not
    allowed (`why`), with `code` `no_engine` or `over_budget`."""

    action: Literal["acquiring", "loading", "ready", "refused"]
    why: str = ""
    code: str = ""
    pod: str = ""


class AcquireRequest(Message, frozen=True, kw_only=True):
    model: str
    reason: str = ""
    fence: int = 0  # the asking scheduler's fencing token (runtime/leader.py); the broker refuses an older one


class AcquireReply(Message, frozen=True, kw_only=True, tag="acquire", tag_field="t"):
    pod: PodInfo


class LeaseRequest(Message, frozen=True, kw_only=True):
    """A warm floor: keep at least `pods` pods of `model` for `ttl_s` seconds, busy or not."""

    model: str
    pods: int
    ttl_s: float


class LeaseReply(Message, frozen=True, kw_only=True, tag="lease", tag_field="t"):
    model: str
    pods: int
    until: float
