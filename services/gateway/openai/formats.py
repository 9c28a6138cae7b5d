"""Engine results into OpenAI-shaped answers (and the extensions' shapes). Pure functions over plain data."""

from __future__ import annotations

import base64
import struct
from typing import Any, TypeVar

import msgspec

from coderai.contracts import (
    DiarizeResult,
    EmbedResult,
    Final,
    OcrResult,
    Output,
    Segment,
    TranscribeResult,
    Turn,
    Usage,
)
from coderai.gateway.errors import ApiError

R = TypeVar("R", bound=Output)


def result(final: Final, kind: type[R]) -> R:
    """`final`'s output, which an engine of the op answers with a `kind`; a 502 when it answered with none."""
    out = final.output
    if not isinstance(out, kind):
        raise ApiError(
            502, f"The engine answered without a {kind.__name__}.", type="engine_error", code="engine_failed"
        )
    return out


def rows(result: EmbedResult) -> list[bytes]:
    """Each vector's float32 little-endian bytes, in input order."""
    row = result.dim * 4
    return [result.vectors[i * row : (i + 1) * row] for i in range(result.count)]


def vectors(result: EmbedResult) -> list[list[float]]:
    return [list(struct.unpack(f"<{result.dim}f", raw)) for raw in rows(result)]


def embeddings(result: EmbedResult, model: str, encoding_format: str, usage: Usage) -> dict[str, Any]:
    """`/v1/embeddings`: float lists, or base64 of each vector's float32 little-endian bytes (what the openai
    SDK asks for by default and decodes with numpy)."""
    vecs: list[Any] = (
        [base64.b64encode(raw).decode() for raw in rows(result)] if encoding_format == "base64" else vectors(result)
    )
    data = [{"object": "embedding", "index": i, "embedding": vec} for i, vec in enumerate(vecs)]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
    }


def rerank(
    request_id: str,
    scores: list[float],
    documents: list[str],
    model: str,
    top_n: int | None,
    return_documents: bool,
    usage: Usage,
) -> dict[str, Any]:
    """`/v1/rerank` (the Jina/Cohere shape vLLM and LocalAI answer): best first, `top_n` of them."""
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if top_n is not None:
        order = order[:top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            item["document"] = {"text": documents[i]}
        results.append(item)
    return {
        "id": request_id,
        "object": "list",
        "model": model,
        "results": results,
        "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
    }


# --- transcription ------------------------------------------------------------------------------------


def assign_speakers(segments: list[Segment], turns: list[Turn]) -> list[Segment]:
    """Each segment gets the speaker whose turns overlap it most (none when no turn overlaps it)."""
    out = []
    for seg in segments:
        overlap: dict[str, float] = {}
        for t in turns:
            o = min(seg.end, t.end) - max(seg.start, t.start)
            if o > 0:
                overlap[t.speaker] = overlap.get(t.speaker, 0.0) + o
        speaker = max(overlap, key=overlap.__getitem__) if overlap else None
        out.append(msgspec.structs.replace(seg, speaker=speaker))
    return out


def _segment_json(s: Segment) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": s.id,
        "seek": 0,
        "start": round(s.start, 3),
        "end": round(s.end, 3),
        "text": s.text,
        "tokens": s.tokens,
        "temperature": s.temperature,
        "avg_logprob": s.avg_logprob,
        "compression_ratio": s.compression_ratio,
        "no_speech_prob": s.no_speech_prob,
    }
    if s.speaker is not None:
        d["speaker"] = s.speaker
    return d


def transcription(
    result: TranscribeResult, response_format: str, task: str, granularities: list[str], usage_seconds: float
) -> tuple[bytes | dict[str, Any], str]:
    """The body and media type of `/v1/audio/transcriptions` or `/translations` in `response_format`."""
    text = result.text.strip()
    speakers = any(s.speaker for s in result.segments)
    if response_format == "text":
        return (text + "\n").encode(), "text/plain; charset=utf-8"
    if response_format == "srt":
        return srt(result.segments).encode(), "application/x-subrip; charset=utf-8"
    if response_format == "vtt":
        return vtt(result.segments).encode(), "text/vtt; charset=utf-8"
    if response_format == "verbose_json":
        body: dict[str, Any] = {
            "task": task,
            "language": result.language,
            "duration": round(result.duration_s, 3),
            "text": text,
        }
        if not granularities or "segment" in granularities:
            body["segments"] = [_segment_json(s) for s in result.segments]
        if "word" in granularities:
            body["words"] = [
                {"word": w.word.strip(), "start": round(w.start, 3), "end": round(w.end, 3)}
                for s in result.segments
                for w in s.words
            ]
        return body, "application/json"
    body = {"text": text, "usage": {"type": "duration", "seconds": int(round(usage_seconds))}}
    if speakers:  # diarize=true: the speakers need somewhere to go even in the short format
        body["segments"] = [
            {"start": round(s.start, 3), "end": round(s.end, 3), "text": s.text, "speaker": s.speaker}
            for s in result.segments
        ]
    return body, "application/json"


def _stamp(t: float, sep: str) -> str:
    ms = int(round(max(t, 0.0) * 1000))
    h, rem = divmod(ms, 3_600_000)
    m, rem = divmod(rem, 60_000)
    s, ms = divmod(rem, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def _cue_text(s: Segment) -> str:
    return (f"[{s.speaker}] " if s.speaker else "") + s.text.strip()


def srt(segments: list[Segment]) -> str:
    """SubRip: numbered cues, `HH:MM:SS,mmm` times, a blank line after each."""
    return "".join(
        f"{i}\n{_stamp(s.start, ',')} --> {_stamp(s.end, ',')}\n{_cue_text(s)}\n\n" for i, s in enumerate(segments, 1)
    )


def vtt(segments: list[Segment]) -> str:
    """WebVTT: a header, then `HH:MM:SS.mmm` cues."""
    return "WEBVTT\n\n" + "".join(
        f"{_stamp(s.start, '.')} --> {_stamp(s.end, '.')}\n{_cue_text(s)}\n\n" for s in segments
    )


# --- diarization, OCR ---------------------------------------------------------------------------------


def diarization(result: DiarizeResult, model: str) -> dict[str, Any]:
    return {
        "object": "diarization",
        "model": model,
        "duration": round(result.duration_s, 3),
        "speakers": result.speakers,
        "segments": [
            {"start": round(t.start, 3), "end": round(t.end, 3), "speaker": t.speaker} for t in result.segments
        ],
    }


def ocr(result: OcrResult, model: str) -> dict[str, Any]:
    pages = [
        {
            "index": p.index,
            "width": p.width,
            "height": p.height,
            "text": p.text,
            "lines": [{"text": ln.text, "box": ln.box, "score": round(ln.score, 4)} for ln in p.lines],
        }
        for p in result.pages
    ]
    return {"object": "ocr", "model": model, "text": "\n\n".join(p.text for p in result.pages), "pages": pages}
