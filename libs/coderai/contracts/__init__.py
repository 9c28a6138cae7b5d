"""The bus contract: msgspec messages, typed subjects, stream and bucket shapes. No I/O here."""

from coderai.contracts.base import Message, decode, encode, why_malformed
from coderai.contracts.errors import BusError, ErrorCode, ErrorReply
from coderai.contracts.events import EngineReady, Event, ModelFetch, ModelLoaded, ModelUnloaded, PartDone, PodEvent, RequestCompleted
from coderai.contracts.jobs import (
    CancelJob,
    ChatJob,
    Choice,
    Chunk,
    CompletionJob,
    Final,
    Frame,
    KeepAlive,
    Op,
    RequestId,
    SamplingParams,
    Usage,
)
from coderai.contracts.keys import model_key, model_name
from coderai.contracts.split import RpcServer, SplitDevice, SplitPlan
from coderai.contracts.media import (
    Blob,
    DiarizeJob,
    DiarizeResult,
    EmbedJob,
    EmbedResult,
    ImageJob,
    ImageResult,
    MediaJob,
    OcrJob,
    OcrLine,
    OcrPage,
    OcrResult,
    Output,
    RerankJob,
    RerankResult,
    Segment,
    SpeechJob,
    SpeechResult,
    TranscribeJob,
    TranscribeResult,
    Turn,
    VideoJob,
    VideoResult,
    Word,
)
from coderai.contracts.families import GGUF_FAMILIES
from coderai.contracts.models import Distribute, ModelConfig, PodPolicy
from coderai.contracts.nodes import Assignment, EngineStatus, GpuMemory, Heartbeat
from coderai.contracts.routing import RouteDecision, RouteRequest
from coderai.contracts.store import StoreChunk, StoreEntry, StoreFetch, StoreList, StoreListing, check_store_path
from coderai.contracts.work import WorkPart

__all__ = [
    "GGUF_FAMILIES",
    "Blob", "DiarizeJob", "DiarizeResult", "EmbedJob", "EmbedResult", "ImageJob", "ImageResult", "MediaJob", "OcrJob",
    "OcrLine", "OcrPage", "OcrResult", "Output", "RerankJob", "RerankResult", "Segment", "SpeechJob", "SpeechResult",
    "TranscribeJob", "TranscribeResult", "Turn", "VideoJob", "VideoResult", "Word",
    "Distribute", "RpcServer", "SplitDevice", "SplitPlan", "PartDone", "PodEvent", "PodPolicy", "StoreChunk", "StoreEntry", "StoreFetch", "StoreList", "StoreListing", "WorkPart", "check_store_path",
    "Assignment", "BusError", "CancelJob", "ChatJob", "Choice", "Chunk", "CompletionJob", "EngineStatus",
    "ErrorCode", "ErrorReply", "Event", "Final", "Frame", "GpuMemory", "Heartbeat", "KeepAlive", "Message", "ModelConfig",
    "EngineReady", "ModelFetch", "ModelLoaded", "ModelUnloaded", "Op", "RequestCompleted", "RequestId", "RouteDecision", "RouteRequest", "SamplingParams",
    "Usage", "decode", "encode", "model_key", "model_name", "why_malformed",
]
