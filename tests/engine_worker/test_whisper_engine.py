"""The faster-whisper engine on a tiny Whisper overfitted on one espeak-ng phrase: real decoding, on the CPU.

The model is built offline once (about half a minute) and cached; it knows one sentence, so exact text can be
asserted for transcription, language detection, translation and every container the engine decodes.
"""

from __future__ import annotations

import numpy as np
import pytest

from coderai.contracts import ModelConfig
from coderai.contracts.media import Blob, TranscribeJob
from coderai.engine_worker.engines import EngineLoadError, audio, available_families, engine_class
from coderai.engine_worker.engines.base import BadInput, CancelFlag
from coderai.testing.speech import RATE, have_espeak, speak_pcm, to_wav
from coderai.tiny_models.whisper import TRAINING_TEXT, ensure_tiny_whisper

pytest.importorskip("faster_whisper")
pytestmark = pytest.mark.slow
if not have_espeak():
    pytest.skip("espeak-ng is not installed (Debian package espeak-ng)", allow_module_level=True)


def words(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def model_dir():
    return ensure_tiny_whisper()


def load(model_dir, **params):
    e = engine_class("whisper")(
        ModelConfig(name="stt", engine="whisper", path=str(model_dir), params={"threads": 2, **params})
    )
    e.load()
    return e


@pytest.fixture(scope="module")
def engine(model_dir):
    e = load(model_dir)
    yield e
    e.close()


@pytest.fixture(scope="module")
def pcm() -> np.ndarray:
    return speak_pcm(TRAINING_TEXT)


def job(data: bytes, **kw) -> TranscribeJob:
    return TranscribeJob(request_id="r", model="stt", audio=Blob(data=data), **kw)


def test_whisper_is_an_available_family():
    assert "whisper" in available_families()


def test_transcribes_the_training_phrase(engine, pcm):
    result, usage = engine.transcribe(job(to_wav(pcm), language="en"), CancelFlag(), None)
    assert words(result.text) == TRAINING_TEXT
    assert result.language == "en"
    assert result.duration_s == pytest.approx(len(pcm) / RATE, abs=0.01)
    produced = sum(len(s.tokens) for s in result.segments)
    assert usage.completion_tokens == produced > 0 and usage.prompt_tokens == 0
    assert usage.total_tokens == produced


def test_detects_the_language_when_none_is_given(engine, pcm):
    result, _ = engine.transcribe(job(to_wav(pcm)), CancelFlag(), None)
    assert result.language == "en" and result.language in engine.languages
    assert words(result.text) == TRAINING_TEXT


def test_segments_are_numbered_and_timed_within_the_audio(engine, pcm):
    progress: list[float] = []
    result, _ = engine.transcribe(job(to_wav(pcm)), CancelFlag(), lambda **f: progress.append(f["progress"]))
    assert [s.id for s in result.segments] == list(range(len(result.segments))) and result.segments
    for s in result.segments:
        assert 0.0 <= s.start < s.end <= result.duration_s
        assert s.avg_logprob <= 0.0 and 0.0 <= s.no_speech_prob <= 1.0 and s.temperature == 0.0
    assert words("".join(s.text for s in result.segments)) == words(result.text)
    assert progress and all(0.0 <= p <= 1.0 for p in progress) and progress == sorted(progress)


def test_word_timestamps_give_timed_words(engine, pcm):
    result, _ = engine.transcribe(job(to_wav(pcm), word_timestamps=True), CancelFlag(), None)
    found = [w for s in result.segments for w in s.words]
    assert words("".join(w.word for w in found)) == TRAINING_TEXT
    for before, w in zip([None, *found], found):
        assert 0.0 <= w.start <= w.end <= result.duration_s and 0.0 <= w.probability <= 1.0
        assert before is None or before.end <= w.start + 1e-6
    assert engine.transcribe(job(to_wav(pcm)), CancelFlag(), None)[0].segments[0].words == []


def test_translate_gives_english_text(engine, pcm):
    result, _ = engine.transcribe(job(to_wav(pcm), task="translate"), CancelFlag(), None)
    assert words(result.text) == TRAINING_TEXT  # English speech, trained to translate to itself
    assert result.language == "en"


def test_a_nonzero_temperature_samples_at_that_temperature(engine, pcm):
    result, _ = engine.transcribe(job(to_wav(pcm), temperature=0.5), CancelFlag(), None)
    assert [s.temperature for s in result.segments] == [0.5] * len(result.segments)
    assert words(result.text) == TRAINING_TEXT  # the model is sure enough that sampling changes nothing


@pytest.mark.parametrize("fmt", ["flac", "mp3", "opus"])
def test_reads_other_containers(engine, pcm, fmt):
    result, _ = engine.transcribe(job(audio.encode(pcm, RATE, fmt), language="en"), CancelFlag(), None)
    assert words(result.text) == TRAINING_TEXT


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"this is not audio at all" * 40, "not audio"),
        (b"", "empty"),
        (to_wav(np.zeros(0, dtype="<i2")), "no audio"),
    ],
)
def test_unreadable_audio_is_bad_input_on_file(engine, data, says):
    with pytest.raises(BadInput, match=says) as err:
        engine.transcribe(job(data), CancelFlag(), None)
    assert err.value.param == "file"


@pytest.mark.parametrize("language", ["xx", "klingon", "EN-us"])
def test_an_unknown_language_is_bad_input_on_language(engine, pcm, language):
    with pytest.raises(BadInput, match="ISO-639-1") as err:
        engine.transcribe(job(to_wav(pcm), language=language), CancelFlag(), None)
    assert err.value.param == "language" and repr(language) in str(err.value)


def test_language_codes_are_case_insensitive(engine, pcm):
    result, _ = engine.transcribe(job(to_wav(pcm), language=" EN "), CancelFlag(), None)
    assert result.language == "en" and words(result.text) == TRAINING_TEXT


def test_long_audio_is_windowed_and_a_cancel_stops_between_segments(model_dir, pcm):
    # each 30-s window opens with the phrase; decoding knobs from params reach faster-whisper (a window
    # conditioned on the previous one's text is something this one-sentence model never saw)
    engine = load(model_dir, condition_on_previous_text=False)
    gap = np.zeros(30 * RATE - len(pcm), dtype="<i2")
    wav = to_wav(np.concatenate([pcm, gap, pcm, gap, pcm]))
    whole, usage = engine.transcribe(job(wav), CancelFlag(), None)
    assert [round(s.start) for s in whole.segments] == [0, 30, 60]
    assert [words(s.text) for s in whole.segments] == [TRAINING_TEXT] * 3
    assert usage.completion_tokens == sum(len(s.tokens) for s in whole.segments)

    cancel = CancelFlag()
    cut, _ = engine.transcribe(job(wav), cancel, lambda **_: cancel.set())  # the caller leaves after one segment
    assert len(cut.segments) == 1 and words(cut.text) == TRAINING_TEXT
    engine.close()


def test_load_refuses_a_folder_that_would_send_faster_whisper_to_the_hub(tmp_path):
    with pytest.raises(EngineLoadError, match="model.bin"):
        load(tmp_path / "tiny")  # not a folder: faster-whisper would take it for a hub model name
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(EngineLoadError, match="tokenizer.json"):
        load(tmp_path)  # no tokenizer.json: faster-whisper would download one


def test_bad_params_fail_the_load_naming_them(model_dir):
    with pytest.raises(EngineLoadError, match="workers"):
        load(model_dir, workers="many")
    with pytest.raises(EngineLoadError, match="compute_type|could not load"):
        load(model_dir, compute_type="int3")
