"""The diarization engine on dialogues spoken by two espeak-ng voices: real embeddings, real clustering, on the CPU."""

from __future__ import annotations

from itertools import permutations

import numpy as np
import pytest

from coderai.contracts import ModelConfig
from coderai.contracts.media import Blob, DiarizeJob
from coderai.engine_worker.engines import EngineLoadError, audio, engine_class
from coderai.engine_worker.engines.base import BadInput, CancelFlag
from coderai.engine_worker.engines.diarize import DiarizeEngine
from coderai.testing.speech import RATE, VOICES, dialogue, have_espeak, to_wav

pytest.importorskip("resemblyzer")
pytest.importorskip("speaker_diarize_lite")
pytest.importorskip("av")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not have_espeak(), reason="needs espeak-ng")]

LINES = [
    "The weather today is quite pleasant and warm.",
    "I would like to go for a long walk in the park.",
    "That sounds like a wonderful idea to me.",
    "Let us leave right after we finish our lunch.",
]


@pytest.fixture(scope="module")
def engine():
    e = engine_class("diarize")(ModelConfig(name="d", engine="diarize", path=""))
    e.load()
    yield e
    e.close()


@pytest.fixture(scope="module")
def talk() -> tuple[bytes, list[tuple[float, float, str]]]:
    """Four turns of about two seconds each, the two voices alternating."""
    return dialogue([(VOICES[i % 2], line) for i, line in enumerate(LINES)])


def job(data: bytes, **kw) -> DiarizeJob:
    return DiarizeJob(request_id="r", model="d", audio=Blob(data=data), **kw)


def correct_share(truth: list[tuple[float, float, str]], result) -> float:
    """Share of the truth's speech time labelled with the right speaker, under the best label mapping."""
    labels = sorted({t.speaker for t in result.segments})
    voices = sorted({v for _, _, v in truth})
    total = sum(e - s for s, e, _ in truth)
    best = 0.0
    for perm in permutations(labels + [None] * len(voices), len(voices)):
        named = dict(zip(voices, perm))
        hit = sum(
            max(0.0, min(e, t.end) - max(s, t.start))
            for s, e, v in truth
            for t in result.segments
            if t.speaker == named[v]
        )
        best = max(best, hit / total)
    return best


def test_two_voices_are_told_apart(engine, talk):
    wav, truth = talk
    result, usage = engine.diarize(job(wav), CancelFlag())
    assert result.speakers == ["SPEAKER_00", "SPEAKER_01"]
    assert {t.speaker for t in result.segments} == set(result.speakers)
    assert correct_share(truth, result) >= 0.8
    assert result.duration_s == pytest.approx(truth[-1][1] + 0.7, abs=0.01)  # the dialogue ends with a gap
    assert all(0 <= t.start < t.end <= result.duration_s for t in result.segments)
    assert usage.prompt_tokens == int(np.ceil(result.duration_s))  # seconds of audio heard


def test_speaker_count_hint_is_honoured(engine, talk):
    wav, truth = talk
    two, _ = engine.diarize(job(wav, num_speakers=2), CancelFlag())
    assert len(two.speakers) == 2 and correct_share(truth, two) >= 0.8
    one, _ = engine.diarize(job(wav, num_speakers=1), CancelFlag())
    assert one.speakers == ["SPEAKER_00"]


def test_one_voice_is_one_speaker(engine):
    wav, _ = dialogue([(VOICES[0], line) for line in LINES[:3]])
    result, _ = engine.diarize(job(wav), CancelFlag())
    assert result.speakers == ["SPEAKER_00"] and len(result.segments) >= 1


def test_compressed_uploads_are_decoded(engine, talk):
    wav, truth = talk
    pcm = (audio.decode(wav, RATE) * 32767).astype(np.int16)
    result, _ = engine.diarize(job(audio.encode(pcm, RATE, "opus")), CancelFlag())
    assert len(result.speakers) == 2 and correct_share(truth, result) >= 0.8


def test_silence_has_no_speakers(engine):
    result, _ = engine.diarize(job(to_wav(np.zeros(3 * RATE, dtype=np.int16))), CancelFlag())
    assert result.segments == [] and result.speakers == []
    assert result.duration_s == pytest.approx(3.0)


def test_a_cancelled_job_stops_without_turns(engine, talk):
    cancel = CancelFlag()
    cancel.set()
    result, _ = engine.diarize(job(talk[0]), cancel)
    assert result.segments == [] and result.duration_s > 10


@pytest.mark.parametrize("data", [b"", b"definitely not an audio file " * 50, bytes(range(256)) * 40])
def test_unreadable_audio_is_bad_input_on_file(engine, data):
    with pytest.raises(BadInput) as err:
        engine.diarize(job(data), CancelFlag())
    assert err.value.param == "file"


def test_zero_speakers_is_bad_input(engine, talk):
    with pytest.raises(BadInput) as err:
        engine.diarize(job(talk[0], num_speakers=0), CancelFlag())
    assert err.value.param == "num_speakers"


def test_bad_config_fails_to_load(tmp_path):
    with pytest.raises(EngineLoadError, match="not found"):
        DiarizeEngine(ModelConfig(name="d", engine="diarize", path=str(tmp_path / "none.pt"))).load()
    with pytest.raises(EngineLoadError, match="hop_s"):
        DiarizeEngine(ModelConfig(name="d", engine="diarize", path="", params={"hop_s": 5.0})).load()
