"""Pod-broker commands."""

from __future__ import annotations

from coderai.contracts.base import Message


class BrokerStatusRequest(Message, frozen=True, kw_only=True):
    pass


class PodInfo(Message, frozen=True, kw_only=True):
    pod_id: str
    gpu_type: str
    hourly_usd: float
    state: str
    model: str = ""


class BrokerStatus(Message, frozen=True, kw_only=True, tag="broker.status", tag_field="t"):
    """`configured`: a RunPod API key is set, so escalation to pods is possible."""

    configured: bool
    pods: list[PodInfo] = []
    spent_usd: float = 0.0
