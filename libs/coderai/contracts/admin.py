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
    """Serve `model` now (a pulled model placed at once, or one sent over the admin API); a model of the same name
    is replaced, unless `replace` is false: then it is a `conflict`."""

    model: ModelConfig
    replace: bool = True


class RemoveModelRequest(Message, frozen=True, kw_only=True):
    """Stop serving model `name`; the reply carries the config it had. Its copies unload once their in-flight
    requests are done."""

    name: str


class PlaceReply(Message, frozen=True, kw_only=True, tag="placed", tag_field="t"):
    model: ModelConfig


# --- membership: joining, revoking, pod credentials (services/scheduler/membership.py) ------------------------


class JoinHello(Message, frozen=True, kw_only=True):
    """A worker asks to join: its node id and a fresh nonce the head must answer."""

    node_id: str
    nonce: str


class JoinChallenge(Message, frozen=True, kw_only=True, tag="join.challenge", tag_field="t"):
    """The head's answer (`proof`: HMAC over the worker's nonce) and a fresh nonce of its own."""

    nonce: str
    proof: str
    # the salt of the credential the head keeps for this id (empty: not a member): a member joining again
    # proves it holds that credential (JoinProof.member_proof)
    member_salt: str = ""


class JoinProof(Message, frozen=True, kw_only=True):
    """The worker's answer to the head's nonce, and the bcrypt hash of the password it will log in with."""

    node_id: str
    nonce: str  # the worker's, as in its hello
    head_nonce: str
    password_hash: str
    proof: str
    member_proof: str = ""  # runtime/cluster.py:member_proof, made with the id's current credential (when a member)


class JoinWelcome(Message, frozen=True, kw_only=True, tag="join.welcome", tag_field="t"):
    """The NATS user the worker now is, the head's TLS certificate to pin (empty: no TLS), sealed with the token."""

    user: str
    tls_fingerprint: str = ""
    ca_pem: str = ""
    proof: str
    # every head's NATS URL (several heads: docs/ha.md), for the worker's next start when the head it joined is
    # down; not sealed: a server there must still show a certificate of the pinned CA
    heads: list[str] = []


class RevokeRequest(Message, frozen=True, kw_only=True):
    node_id: str
    forget: bool = False  # True: also let it join again later (the id leaves the revoked list)


class MembersRequest(Message, frozen=True, kw_only=True):
    pass


class MemberInfo(Message, frozen=True, kw_only=True):
    node_id: str
    kind: str
    joined_at: float
    expires_at: float = 0.0
    addr: str = ""


class MembersReply(Message, frozen=True, kw_only=True, tag="members", tag_field="t"):
    members: list[MemberInfo]
    revoked: list[str] = []


class PodUserRequest(Message, frozen=True, kw_only=True):
    """The pod-broker asks for the credentials of a pod it is about to rent; they end after `ttl_s`."""

    pod_id: str
    ttl_s: float = 24 * 3600
    models: list[ModelConfig] = []  # what it will serve: the fan-out parts it may pull


class PodUser(Message, frozen=True, kw_only=True, tag="pod.user", tag_field="t"):
    user: str
    password: str
    expires_at: float
