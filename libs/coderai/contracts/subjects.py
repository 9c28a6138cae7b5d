"""Typed subjects: every subject string in coderai is built from one of these, never by hand.

A `Subject` (`subject.py`) knows its pattern, the type it carries and the type its replies carry, so callers and
handlers that use the object cannot drift apart on a typo. Each op's engine subject is declared with its op in
`ops.py` and imported from here like every other.
"""

from __future__ import annotations

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
from coderai.contracts.events import (
    EngineReady,
    Event,
    ModelFetch,
    ModelLoaded,
    ModelUnloaded,
    PartDone,
    PodEvent,
    RequestCompleted,
)
from coderai.contracts.jobs import CancelJob
from coderai.contracts.media import BlobPiece, BlobRead, BlobWrite, BlobWritten
from coderai.contracts.nodes import Heartbeat
from coderai.contracts.ops import ENGINE_CHAT as ENGINE_CHAT
from coderai.contracts.ops import ENGINE_COMPLETE as ENGINE_COMPLETE
from coderai.contracts.ops import ENGINE_DIARIZE as ENGINE_DIARIZE
from coderai.contracts.ops import ENGINE_EMBED as ENGINE_EMBED
from coderai.contracts.ops import ENGINE_IMAGE as ENGINE_IMAGE
from coderai.contracts.ops import ENGINE_OCR as ENGINE_OCR
from coderai.contracts.ops import ENGINE_RERANK as ENGINE_RERANK
from coderai.contracts.ops import ENGINE_SPEECH as ENGINE_SPEECH
from coderai.contracts.ops import ENGINE_TRANSCRIBE as ENGINE_TRANSCRIBE
from coderai.contracts.ops import ENGINE_VIDEO as ENGINE_VIDEO
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
from coderai.contracts.subject import PREFIX as PREFIX
from coderai.contracts.subject import Subject
from coderai.contracts.subject import check_token as check_token
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

ROUTE_PICK = Subject("coderai.route.pick", RouteRequest, RouteDecision)
ENGINE_CANCEL = Subject("coderai.engine.{node_id}.{engine_id}.cancel", CancelJob)
HEARTBEAT = Subject("coderai.hb.{node_id}", Heartbeat, bind=("node_id",))
EVENTS_ALL: Subject[Event, None] = Subject("coderai.evt.>", Event)
EVT_REQUEST_COMPLETED = Subject("coderai.evt.request.completed", RequestCompleted)
EVT_MODEL_LOADED = Subject("coderai.evt.model.loaded.{node_id}", ModelLoaded, bind=("node_id",))
EVT_MODEL_FETCH = Subject("coderai.evt.model.fetch.{node_id}", ModelFetch, bind=("node_id",))
EVT_MODEL_UNLOADED = Subject("coderai.evt.model.unloaded", ModelUnloaded)  # published by the scheduler
EVT_ENGINE_READY = Subject("coderai.evt.engine.ready.{model_key}", EngineReady)  # published by the router
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

ENGINE_STAGE: Subject[StageJob, StageFrame] = Subject(
    "coderai.engine.{node_id}.{engine_id}.stage", StageJob, StageFrame
)  # one stage of a relayed video
CMD_SCHEDULER_STAGES = Subject("coderai.cmd.scheduler.stages", StagePlanRequest, StagePlan)

CMD_SCHEDULER_TRAIN = Subject("coderai.cmd.scheduler.train", FineTuneCreate, FineTuneReply)
CMD_SCHEDULER_TRAIN_CANCEL = Subject("coderai.cmd.scheduler.train_cancel", FineTuneCancel, FineTuneReply)
CMD_NODE_TRAIN = Subject("coderai.cmd.node.{node_id}.train", TrainSpec, TrainStarted)
CMD_NODE_TRAIN_STOP = Subject("coderai.cmd.node.{node_id}.train_stop", TrainStop, TrainStopped)
CMD_NODE_TRAIN_STATE = Subject("coderai.cmd.node.{node_id}.train_state", TrainStateAsk, TrainState)
TRAIN_REPORT = Subject("coderai.train.report.{job_id}.{node_id}", TrainReport, bind=("job_id", "node_id"))
TRAIN_UPLOAD = Subject("coderai.train.upload.{job_id}.{node_id}", AdapterChunk, AdapterAck, bind=("job_id", "node_id"))
