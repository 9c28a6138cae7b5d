"""One `OpSpec` per op: every table about ops (subjects, LLM or not, fan-out or not, span names, usage kinds)
derives from `OPS`, so adding an op is its name in `jobs.py:EngineOp`, its engine subject and one entry here, one
`gateway/openai/` module and the engine's method (docs/architecture.md, "Adding an op"). Which families serve an
op by default is each family's to say (`families.py`).

Below `subjects.py`, `models.py` and `work.py`, which read these tables: it imports only the jobs and `Subject`."""

from __future__ import annotations

from dataclasses import dataclass

from coderai.contracts.jobs import ChatJob, CompletionJob, EngineOp, Frame
from coderai.contracts.media import (
    DiarizeJob,
    EmbedJob,
    ImageJob,
    OcrJob,
    RerankJob,
    SpeechJob,
    TranscribeJob,
    VideoJob,
)
from coderai.contracts.subject import Subject

# each op's engine subject, declared here with its op (not in subjects.py, which imports this module)
ENGINE_CHAT: Subject[ChatJob, Frame] = Subject("coderai.engine.{node_id}.{engine_id}.chat", ChatJob, Frame)
ENGINE_COMPLETE: Subject[CompletionJob, Frame] = Subject(
    "coderai.engine.{node_id}.{engine_id}.complete", CompletionJob, Frame
)
ENGINE_EMBED: Subject[EmbedJob, Frame] = Subject("coderai.engine.{node_id}.{engine_id}.embed", EmbedJob, Frame)
ENGINE_RERANK: Subject[RerankJob, Frame] = Subject("coderai.engine.{node_id}.{engine_id}.rerank", RerankJob, Frame)
ENGINE_IMAGE: Subject[ImageJob, Frame] = Subject("coderai.engine.{node_id}.{engine_id}.image", ImageJob, Frame)
ENGINE_SPEECH: Subject[SpeechJob, Frame] = Subject("coderai.engine.{node_id}.{engine_id}.speech", SpeechJob, Frame)
ENGINE_TRANSCRIBE: Subject[TranscribeJob, Frame] = Subject(
    "coderai.engine.{node_id}.{engine_id}.transcribe", TranscribeJob, Frame
)
ENGINE_DIARIZE: Subject[DiarizeJob, Frame] = Subject("coderai.engine.{node_id}.{engine_id}.diarize", DiarizeJob, Frame)
ENGINE_OCR: Subject[OcrJob, Frame] = Subject("coderai.engine.{node_id}.{engine_id}.ocr", OcrJob, Frame)
ENGINE_VIDEO: Subject[VideoJob, Frame] = Subject("coderai.engine.{node_id}.{engine_id}.video", VideoJob, Frame)


@dataclass(frozen=True)
class OpSpec:
    """What coderai knows about one op. `llm`: answered with choices (tokens stream); otherwise with an `output`.
    `fanout`: a request may be split over every worker holding the model (parts on `WORK`). `batch`: a batch's
    lines (`/v1/batches`) of it go on `WORK` whole, pulled by every worker holding the model. `blobs`: its job
    carries uploads (packed into the object store when big), so its size is checked after packing. `kind`: the
    model capability and usage kind it is listed as."""

    name: EngineOp
    job: type
    subject: Subject
    span: str
    kind: str
    llm: bool = False
    fanout: bool = False
    batch: bool = False
    blobs: bool = False


OPS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        OpSpec("chat", ChatJob, ENGINE_CHAT, "POST /v1/chat/completions", "chat", llm=True, batch=True),
        OpSpec("complete", CompletionJob, ENGINE_COMPLETE, "POST /v1/completions", "completion", llm=True),
        OpSpec("embed", EmbedJob, ENGINE_EMBED, "POST /v1/embeddings", "embedding", fanout=True, batch=True),
        OpSpec("rerank", RerankJob, ENGINE_RERANK, "POST /v1/rerank", "rerank", fanout=True),
        OpSpec("image", ImageJob, ENGINE_IMAGE, "POST /v1/images", "image", fanout=True, blobs=True),
        OpSpec("speech", SpeechJob, ENGINE_SPEECH, "POST /v1/audio/speech", "speech", fanout=True),
        OpSpec(
            "transcribe",
            TranscribeJob,
            ENGINE_TRANSCRIBE,
            "POST /v1/audio/transcriptions",
            "transcription",
            fanout=True,
            blobs=True,
        ),
        OpSpec("diarize", DiarizeJob, ENGINE_DIARIZE, "POST /v1/audio/diarization", "diarization", blobs=True),
        OpSpec("ocr", OcrJob, ENGINE_OCR, "POST /v1/ocr", "ocr", fanout=True, blobs=True),
        OpSpec("video", VideoJob, ENGINE_VIDEO, "POST /v1/videos", "video"),
    )
}

ENGINE_OPS: dict[str, Subject] = {name: s.subject for name, s in OPS.items()}
LLM_OPS = frozenset(name for name, s in OPS.items() if s.llm)
FANOUT_OPS = frozenset(name for name, s in OPS.items() if s.fanout)
BATCH_OPS = frozenset(name for name, s in OPS.items() if s.batch)
SPAN_NAMES = {name: s.span for name, s in OPS.items()}
KINDS = {name: s.kind for name, s in OPS.items()}


def kind_of(op: str) -> str:
    """The op's kind (an unknown op, e.g. `train`, is its own)."""
    return KINDS.get(op, op)
