"""Engine results into OpenAI shapes: embeddings (float, base64), rerank order, transcripts, speakers."""

from __future__ import annotations

import base64
import struct

from coderai.contracts import (
    DiarizeResult,
    EmbedResult,
    OcrLine,
    OcrPage,
    OcrResult,
    Segment,
    TranscribeResult,
    Turn,
    Usage,
    Word,
)
from coderai.gateway.openai import formats


def _vectors(rows: list[list[float]]) -> EmbedResult:
    raw = b"".join(struct.pack(f"<{len(r)}f", *r) for r in rows)
    return EmbedResult(vectors=raw, count=len(rows), dim=len(rows[0]))


def test_embeddings_float_and_base64_carry_the_same_vectors():
    res = _vectors([[1.0, 0.5, -2.0], [0.25, 0.0, 3.0]])
    floats = formats.embeddings(res, "m", "float", Usage(prompt_tokens=7))
    b64 = formats.embeddings(res, "m", "base64", Usage(prompt_tokens=7))
    assert [d["index"] for d in floats["data"]] == [0, 1]
    assert floats["data"][1]["embedding"] == [0.25, 0.0, 3.0]
    decoded = struct.unpack("<3f", base64.b64decode(b64["data"][0]["embedding"]))
    assert list(decoded) == floats["data"][0]["embedding"]
    assert floats["usage"] == {"prompt_tokens": 7, "total_tokens": 7} and floats["model"] == "m"


def test_rerank_sorts_best_first_and_cuts_at_top_n():
    body = formats.rerank("r1", [0.1, 0.9, 0.5], ["a", "b", "c"], "m", 2, True, Usage(prompt_tokens=3))
    assert [r["index"] for r in body["results"]] == [1, 2]
    assert body["results"][0] == {"index": 1, "relevance_score": 0.9, "document": {"text": "b"}}
    bare = formats.rerank("r1", [0.1, 0.9, 0.5], ["a", "b", "c"], "m", None, False, Usage())
    assert [r["index"] for r in bare["results"]] == [1, 2, 0] and "document" not in bare["results"][0]


SEGS = [
    Segment(id=0, start=0.0, end=1.5, text=" Hello there.", words=[Word(word=" Hello", start=0.0, end=0.6)]),
    Segment(id=1, start=61.25, end=3723.5, text=" Bye."),
]
RESULT = TranscribeResult(text=" Hello there. Bye.", language="en", duration_s=3724.0, segments=SEGS)


def test_srt_and_vtt_timestamps():
    srt = formats.srt(SEGS)
    assert srt.startswith(
        "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n2\n00:01:01,250 --> 01:02:03,500\nBye.\n\n"
    )
    vtt = formats.vtt(SEGS)
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n\n")


def test_transcription_formats():
    body, ctype = formats.transcription(RESULT, "json", "transcribe", [], 3724.0)
    assert body["text"] == "Hello there. Bye." and ctype == "application/json" and "segments" not in body
    text, ctype = formats.transcription(RESULT, "text", "transcribe", [], 1)
    assert text == b"Hello there. Bye.\n" and ctype.startswith("text/plain")
    verbose, _ = formats.transcription(RESULT, "verbose_json", "translate", ["word", "segment"], 1)
    assert verbose["task"] == "translate" and verbose["language"] == "en" and verbose["duration"] == 3724.0
    assert verbose["words"] == [{"word": "Hello", "start": 0.0, "end": 0.6}] and len(verbose["segments"]) == 2
    words_only, _ = formats.transcription(RESULT, "verbose_json", "transcribe", ["word"], 1)
    assert "segments" not in words_only


def test_speakers_go_to_the_turn_that_overlaps_most():
    turns = [
        Turn(start=0.0, end=1.0, speaker="SPEAKER_00"),
        Turn(start=1.0, end=2.0, speaker="SPEAKER_01"),
        Turn(start=60.0, end=4000.0, speaker="SPEAKER_01"),
    ]
    segs = formats.assign_speakers(SEGS, turns)
    assert [s.speaker for s in segs] == ["SPEAKER_00", "SPEAKER_01"]
    assert formats.assign_speakers(SEGS, [])[0].speaker is None
    body, _ = formats.transcription(TranscribeResult(text="x", segments=segs), "json", "transcribe", [], 1)
    assert [s["speaker"] for s in body["segments"]] == ["SPEAKER_00", "SPEAKER_01"]
    assert formats.srt(segs).splitlines()[2] == "[SPEAKER_00] Hello there."


def test_diarization_and_ocr_shapes():
    d = formats.diarization(
        DiarizeResult(segments=[Turn(start=0.1234, end=1.0, speaker="A")], speakers=["A"], duration_s=2.0), "dia"
    )
    assert d["segments"] == [{"start": 0.123, "end": 1.0, "speaker": "A"}] and d["speakers"] == ["A"]
    page = OcrPage(
        index=0,
        width=10,
        height=10,
        text="hi",
        lines=[OcrLine(text="hi", box=[[0, 0], [5, 0], [5, 5], [0, 5]], score=0.99)],
    )
    o = formats.ocr(OcrResult(pages=[page, OcrPage(index=1, width=1, height=1, text="there")]), "ocr")
    assert o["text"] == "hi\n\nthere" and o["pages"][0]["lines"][0]["text"] == "hi"
