"""Operator commands: node logs and drain (to a worker), node listing and model placement (to the scheduler)."""

from __future__ import annotations

from typing import Literal

from coderai.contracts.base import Message
from coderai.contracts.models import ModelConfig
from coderai.contracts.nodes import Heartbeat
from coderai.contracts.split import SplitPlan


class NodeLogsRequest(Message, frozen=True, kw_only=True):
    lines: int = 200


class NodeLogs(Message, frozen=True, kw_only=True, tag="node.logs", tag_field="t"):
    """The worker's last log lines (it keeps 2,000), oldest first."""

    node_id: str
    lines: list[str]


class DrainRequest(Message, frozen=True, kw_only=True):
    """`drain=True`: finish what is running, take nothing new; `False`: take work again."""

    drain: bool = True


class NodeState(Message, frozen=True, kw_only=True, tag="node.state", tag_field="t"):
    node_id: str
    draining: bool
    in_flight: int


class NodesRequest(Message, frozen=True, kw_only=True):
    pass


class NodeInfo(Message, frozen=True, kw_only=True):
    heartbeat: Heartbeat
    assigned: list[str] = []
    age_s: float = 0.0


class NodesReply(Message, frozen=True, kw_only=True, tag="nodes", tag_field="t"):
    nodes: list[NodeInfo]
    unplaced: dict[str, str] = {}
    splits: dict[str, SplitPlan] = {}  # models split over several nodes: which devices hold which layers


class PlaceRequest(Message, frozen=True, kw_only=True):
    """Add a node to a model's nodes (`place`) or take it off (`unplace`); copies move at once."""

    model: str
    node: str
    action: Literal["place", "unplace"] = "place"


class AddModelRequest(Message, frozen=True, kw_only=True):
    """Serve `model` now (a pulled model placed at once); a model of the same name is replaced."""

    model: ModelConfig


class PlaceReply(Message, frozen=True, kw_only=True, tag="placed", tag_field="t"):
    model: ModelConfig
