"""One `OpSpec` per op: every table about ops (subjects, LLM or not, fan-out or not, span names, usage kinds,
default engine families) derives from `OPS`, so adding an op is its name in `jobs.py:EngineOp`, its engine subject
and one entry here, one `gateway/openai/` module and the engine's method (docs/architecture.md, "Adding an op").

Below `subjects.py`, `models.py` and `work.py`, which read these tables: it imports only the jobs and `Subject`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from coderai.contracts.jobs import ChatJob, CompletionJob, EngineOp, Frame, Op
from coderai.contracts.media import DiarizeJob, EmbedJob, ImageJob, OcrJob, RerankJob, SpeechJob, TranscribeJob, VideoJob
from coderai.contracts.subject import Subject

EngineFamily = Literal["llama", "llama-server", "vllm", "embed", "diffusers", "whisper", "tts", "diarize", "ocr", "video",
                       "transformers", "echo"]
"""The engine families a worker can load (`engine_worker/engines`): a model's `engine`. Every one serves an op of
`OPS` by default, so `DEFAULT_OPS` has exactly these keys (tests/contracts/test_contracts_layering.py)."""

# each op's engine subject, declared here with its op (not in subjects.py, which imports this module)
ENGINE_CHAT = Subject("coderai.engine.{node_id}.{engine_id}.chat", ChatJob, Frame)
ENGINE_COMPLETE = Subject("coderai.engine.{node_id}.{engine_id}.complete", CompletionJob, Frame)
ENGINE_EMBED = Subject("coderai.engine.{node_id}.{engine_id}.embed", EmbedJob, Frame)
ENGINE_RERANK = Subject("coderai.engine.{node_id}.{engine_id}.rerank", RerankJob, Frame)
ENGINE_IMAGE = Subject("coderai.engine.{node_id}.{engine_id}.image", ImageJob, Frame)
ENGINE_SPEECH = Subject("coderai.engine.{node_id}.{engine_id}.speech", SpeechJob, Frame)
ENGINE_TRANSCRIBE = Subject("coderai.engine.{node_id}.{engine_id}.transcribe", TranscribeJob, Frame)
ENGINE_DIARIZE = Subject("coderai.engine.{node_id}.{engine_id}.diarize", DiarizeJob, Frame)
ENGINE_OCR = Subject("coderai.engine.{node_id}.{engine_id}.ocr", OcrJob, Frame)
ENGINE_VIDEO = Subject("coderai.engine.{node_id}.{engine_id}.video", VideoJob, Frame)


@dataclass(frozen=True)
class OpSpec:
    """What coderai knows about one op. `llm`: answered with choices (tokens stream); otherwise with an `output`.
    `fanout`: a request may be split over every worker holding the model (parts on `WORK`). `batch`: a batch's
    lines (`/v1/batches`) of it go on `WORK` whole, pulled by every worker holding the model. `blobs`: its job
    carries uploads (packed into the object store when big), so its size is checked after packing. `kind`: the
    model capability and usage kind it is listed as. `families`: the engine families that serve it by default."""

    name: EngineOp
    job: type
    subject: Subject
    span: str
    kind: str
    families: tuple[EngineFamily, ...]
    llm: bool = False
    fanout: bool = False
    batch: bool = False
    blobs: bool = False


_LLM_FAMILIES: tuple[EngineFamily, ...] = ("llama", "llama-server", "vllm", "transformers", "echo")

OPS: dict[str, OpSpec] = {s.name: s for s in (
    OpSpec("chat", ChatJob, ENGINE_CHAT, "POST /v1/chat/completions", "chat", _LLM_FAMILIES, llm=True,
           batch=True),
    OpSpec("complete", CompletionJob, ENGINE_COMPLETE, "POST /v1/completions", "completion", _LLM_FAMILIES, llm=True),
    OpSpec("embed", EmbedJob, ENGINE_EMBED, "POST /v1/embeddings", "embedding", ("embed",), fanout=True,
           batch=True),
    OpSpec("rerank", RerankJob, ENGINE_RERANK, "POST /v1/rerank", "rerank", ("embed",), fanout=True),
    OpSpec("image", ImageJob, ENGINE_IMAGE, "POST /v1/images", "image", ("diffusers",), fanout=True, blobs=True),
    OpSpec("speech", SpeechJob, ENGINE_SPEECH, "POST /v1/audio/speech", "speech", ("tts",), fanout=True),
    OpSpec("transcribe", TranscribeJob, ENGINE_TRANSCRIBE, "POST /v1/audio/transcriptions", "transcription",
           ("whisper",), fanout=True, blobs=True),
    OpSpec("diarize", DiarizeJob, ENGINE_DIARIZE, "POST /v1/audio/diarization", "diarization", ("diarize",),
           blobs=True),
    OpSpec("ocr", OcrJob, ENGINE_OCR, "POST /v1/ocr", "ocr", ("ocr",), fanout=True, blobs=True),
    OpSpec("video", VideoJob, ENGINE_VIDEO, "POST /v1/videos", "video", ("video",)),
)}

ENGINE_OPS: dict[str, Subject] = {name: s.subject for name, s in OPS.items()}
LLM_OPS = frozenset(name for name, s in OPS.items() if s.llm)
FANOUT_OPS = frozenset(name for name, s in OPS.items() if s.fanout)
BATCH_OPS = frozenset(name for name, s in OPS.items() if s.batch)
SPAN_NAMES = {name: s.span for name, s in OPS.items()}
KINDS = {name: s.kind for name, s in OPS.items()}
DEFAULT_OPS: dict[EngineFamily, list[Op]] = {}
for _spec in OPS.values():
    for _family in _spec.families:
        DEFAULT_OPS.setdefault(_family, []).append(_spec.name)


def kind_of(op: str) -> str:
    """The op's kind (an unknown op, e.g. `train`, is its own)."""
    return KINDS.get(op, op)
