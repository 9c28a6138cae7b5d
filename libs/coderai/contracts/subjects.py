"""Typed subjects: every subject string in coderai is built here, never by hand.

A `Subject` knows its pattern, the type it carries and the type its replies carry, so callers and
handlers that use the object cannot drift apart on a typo.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, Union

from coderai.contracts.admin import (
    AddModelRequest,
    DrainRequest,
    JoinChallenge,
    JoinHello,
    JoinProof,
    JoinWelcome,
    MembersReply,
    MembersRequest,
    PodUser,
    PodUserRequest,
    RevokeRequest,
    NodeLogs,
    NodeLogsRequest,
    NodesReply,
    NodesRequest,
    NodeState,
    PlaceReply,
    PlaceRequest,
    RemoveModelRequest,
)
from coderai.contracts.base import decode, encode
from coderai.contracts.errors import ErrorReply
from coderai.contracts.events import Event, ModelFetch, ModelLoaded, ModelUnloaded, PartDone, PodEvent, RequestCompleted
from coderai.contracts.jobs import CancelJob, ChatJob, CompletionJob, Frame
from coderai.contracts.media import (
    BlobPiece,
    BlobRead,
    BlobWrite,
    BlobWritten,
    DiarizeJob,
    EmbedJob,
    ImageJob,
    OcrJob,
    RerankJob,
    SpeechJob,
    TranscribeJob,
    VideoJob,
)
from coderai.contracts.nodes import Heartbeat
from coderai.contracts.work import WorkPart
from coderai.contracts.pods import (
    AcquireReply,
    AcquireRequest,
    BrokerStatus,
    BrokerStatusRequest,
    EscalateReply,
    EscalateRequest,
    LeaseReply,
    LeaseRequest,
)
from coderai.contracts.routing import RouteDecision, RouteRequest
from coderai.contracts.stages import StageFrame, StageJob, StagePlan, StagePlanRequest
from coderai.contracts.store import StoreChunk, StoreFetch, StoreList, StoreListing
from coderai.contracts.training import (
    AdapterAck,
    AdapterChunk,
    FineTuneCancel,
    FineTuneCreate,
    FineTuneReply,
    TrainReport,
    TrainSpec,
    TrainStarted,
    TrainState,
    TrainStateAsk,
    TrainStop,
    TrainStopped,
)

Req = TypeVar("Req")

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
class Subject(Generic[Req]):
    """A subject pattern such as `coderai.hb.{node_id}` with its request type and reply type (None: no reply)."""

    pattern: str
    request: type[Req] | Any
    reply: Any = None
    bind: tuple[str, ...] = ()
    """Placeholders that name the sender (e.g. `node_id`): NATS lets a node publish only under its own id, and a
    message whose field of that name says another id is dropped (`bound_to`), so no node speaks for another."""
    params: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(_PLACEHOLDER.findall(self.pattern)))
        # what every message on the hot path would otherwise build again: the types checked and decoded, and the
        # concrete subjects made so far (a few per engine; bounded, for subjects that name a job)
        object.__setattr__(self, "_request_types", _types(self.request))
        object.__setattr__(self, "_reply_type", Union[self.reply, ErrorReply])
        object.__setattr__(self, "_made", {})

    def __call__(self, **values: str) -> str:
        """The concrete subject; every placeholder must be given a valid token."""
        key = tuple(values.items())
        made = self._made.get(key)  # type: ignore[attr-defined]
        if made is not None:
            return made
        if set(values) != set(self.params):
            raise TypeError(f"{self.pattern} needs {self.params}, got {tuple(values)}")
        made = self.pattern.format(**{k: check_token(v, k) for k, v in values.items()})
        if len(self._made) >= _MADE_MAX:  # type: ignore[attr-defined]
            self._made.clear()  # type: ignore[attr-defined]
        self._made[key] = made  # type: ignore[attr-defined]
        return made

    def wildcard(self, **values: str) -> str:
        """A subscription subject: given placeholders filled in, the rest `*`."""
        filled = {p: check_token(values[p], p) if p in values else "*" for p in self.params}
        return self.pattern.format(**filled)

    def parse(self, subject: str) -> dict[str, str]:
        """The placeholder values of a concrete subject of this pattern."""
        regex = "^" + _PLACEHOLDER.sub(r"(?P<\1>[^.]+)", re.escape(self.pattern).replace(r"\{", "{").replace(r"\}", "}")) + "$"
        m = re.match(regex, subject)
        if not m:
            raise ValueError(f"{subject!r} does not match {self.pattern}")
        return m.groupdict()

    def bound_to(self, subject: str, msg: Any) -> bool:
        """True when every bound placeholder of `subject` equals the same-named field of `msg`."""
        if not self.bind:
            return True
        try:
            values = self.parse(subject)
        except ValueError:
            return False
        return all(getattr(msg, name, None) == values.get(name) for name in self.bind)

    def encode(self, msg: Req) -> bytes:
        if not isinstance(msg, self._request_types):  # type: ignore[attr-defined]
            raise TypeError(f"{self.pattern} carries {self.request}, not {type(msg).__name__}")
        return encode(msg)

    def decode(self, data: bytes) -> Req:
        return decode(data, self.request)

    def decode_reply(self, data: bytes) -> Any:
        """A reply of this subject: its reply type, or an ErrorReply."""
        return decode(data, self._reply_type)  # type: ignore[attr-defined]


def _types(t: Any) -> tuple[type, ...]:
    args = getattr(t, "__args__", None)
    return tuple(args) if args else (t,)


ROUTE_PICK = Subject("coderai.route.pick", RouteRequest, RouteDecision)
ENGINE_CHAT = Subject("coderai.engine.{node_id}.{engine_id}.chat", ChatJob, Frame)
ENGINE_COMPLETE = Subject("coderai.engine.{node_id}.{engine_id}.complete", CompletionJob, Frame)
ENGINE_CANCEL = Subject("coderai.engine.{node_id}.{engine_id}.cancel", CancelJob)
HEARTBEAT = Subject("coderai.hb.{node_id}", Heartbeat, bind=("node_id",))
EVENTS_ALL = Subject("coderai.evt.>", Event)
EVT_REQUEST_COMPLETED = Subject("coderai.evt.request.completed", RequestCompleted)
EVT_MODEL_LOADED = Subject("coderai.evt.model.loaded.{node_id}", ModelLoaded, bind=("node_id",))
EVT_MODEL_FETCH = Subject("coderai.evt.model.fetch.{node_id}", ModelFetch, bind=("node_id",))
EVT_MODEL_UNLOADED = Subject("coderai.evt.model.unloaded", ModelUnloaded)  # published by the scheduler
EVT_PART_DONE = Subject("coderai.evt.work.part.{node_id}", PartDone, bind=("node_id",))
WORK_PART = Subject("coderai.work.{model_key}.{op}", WorkPart)

CMD_BROKER_STATUS = Subject("coderai.cmd.broker.status", BrokerStatusRequest, BrokerStatus)
CMD_BROKER_ACQUIRE = Subject("coderai.cmd.broker.acquire", AcquireRequest, AcquireReply)
CMD_BROKER_LEASE = Subject("coderai.cmd.broker.lease", LeaseRequest, LeaseReply)
CMD_SCHEDULER_ESCALATE = Subject("coderai.cmd.scheduler.escalate", EscalateRequest, EscalateReply)
EVT_POD = Subject("coderai.evt.pod.{what}", PodEvent)

CMD_NODE_LOGS = Subject("coderai.cmd.node.{node_id}.logs", NodeLogsRequest, NodeLogs)
CMD_NODE_DRAIN = Subject("coderai.cmd.node.{node_id}.drain", DrainRequest, NodeState)
CMD_SCHEDULER_NODES = Subject("coderai.cmd.scheduler.nodes", NodesRequest, NodesReply)
CMD_SCHEDULER_PLACE = Subject("coderai.cmd.scheduler.place", PlaceRequest, PlaceReply)
CMD_SCHEDULER_ADD = Subject("coderai.cmd.scheduler.add", AddModelRequest, PlaceReply)
CMD_SCHEDULER_REMOVE = Subject("coderai.cmd.scheduler.remove", RemoveModelRequest, PlaceReply)
JOIN_HELLO = Subject("coderai.join.hello", JoinHello, JoinChallenge)  # the only subjects user `join` may use
JOIN_PROVE = Subject("coderai.join.prove", JoinProof, JoinWelcome)
CMD_SCHEDULER_MEMBERS = Subject("coderai.cmd.scheduler.members", MembersRequest, MembersReply)
CMD_SCHEDULER_REVOKE = Subject("coderai.cmd.scheduler.revoke", RevokeRequest, MembersReply)
CMD_SCHEDULER_POD_USER = Subject("coderai.cmd.scheduler.pod_user", PodUserRequest, PodUser)
CMD_BLOB_READ = Subject("coderai.cmd.blob.read", BlobRead, BlobPiece)  # nodes' only way to blobs (gateway)
CMD_BLOB_WRITE = Subject("coderai.cmd.blob.write", BlobWrite, BlobWritten)
CMD_STORE_FETCH = Subject("coderai.cmd.store.fetch", StoreFetch, StoreChunk)
CMD_STORE_LIST = Subject("coderai.cmd.store.list", StoreList, StoreListing)

ENGINE_EMBED = Subject("coderai.engine.{node_id}.{engine_id}.embed", EmbedJob, Frame)
ENGINE_RERANK = Subject("coderai.engine.{node_id}.{engine_id}.rerank", RerankJob, Frame)
ENGINE_IMAGE = Subject("coderai.engine.{node_id}.{engine_id}.image", ImageJob, Frame)
ENGINE_SPEECH = Subject("coderai.engine.{node_id}.{engine_id}.speech", SpeechJob, Frame)
ENGINE_TRANSCRIBE = Subject("coderai.engine.{node_id}.{engine_id}.transcribe", TranscribeJob, Frame)
ENGINE_DIARIZE = Subject("coderai.engine.{node_id}.{engine_id}.diarize", DiarizeJob, Frame)
ENGINE_OCR = Subject("coderai.engine.{node_id}.{engine_id}.ocr", OcrJob, Frame)
ENGINE_VIDEO = Subject("coderai.engine.{node_id}.{engine_id}.video", VideoJob, Frame)
ENGINE_STAGE = Subject("coderai.engine.{node_id}.{engine_id}.stage", StageJob, StageFrame)  # one stage of a relayed video
CMD_SCHEDULER_STAGES = Subject("coderai.cmd.scheduler.stages", StagePlanRequest, StagePlan)

CMD_SCHEDULER_TRAIN = Subject("coderai.cmd.scheduler.train", FineTuneCreate, FineTuneReply)
CMD_SCHEDULER_TRAIN_CANCEL = Subject("coderai.cmd.scheduler.train_cancel", FineTuneCancel, FineTuneReply)
CMD_NODE_TRAIN = Subject("coderai.cmd.node.{node_id}.train", TrainSpec, TrainStarted)
CMD_NODE_TRAIN_STOP = Subject("coderai.cmd.node.{node_id}.train_stop", TrainStop, TrainStopped)
CMD_NODE_TRAIN_STATE = Subject("coderai.cmd.node.{node_id}.train_state", TrainStateAsk, TrainState)
TRAIN_REPORT = Subject("coderai.train.report.{job_id}.{node_id}", TrainReport, bind=("job_id", "node_id"))
TRAIN_UPLOAD = Subject("coderai.train.upload.{job_id}.{node_id}", AdapterChunk, AdapterAck, bind=("job_id", "node_id"))

