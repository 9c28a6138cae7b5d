"""Fan-out plans split a job into valid sub-jobs covering every item once, in order, and merging fake engines'
answers to the parts gives exactly what the same fake engine answers for the whole job."""

from __future__ import annotations

import io
import itertools
import random
import struct
import sys
import wave

import msgspec
import pytest

from coderai.contracts import Usage
from coderai.contracts.media import (
    Blob,
    DiarizeJob,
    EmbedJob,
    EmbedResult,
    ImageJob,
    ImageResult,
    OcrJob,
    OcrPage,
    OcrResult,
    RerankJob,
    RerankResult,
    Segment,
    SpeechJob,
    SpeechResult,
    TranscribeJob,
    TranscribeResult,
    VideoJob,
    Word,
)
from coderai.contracts import Distribute
from coderai.gateway.fanout import audio as fp
from coderai.gateway.fanout.audio import group_sizes
from coderai.gateway.fanout.plans import MergeError, Plan, chunk_sizes, merge, plan

ON = Distribute()
TEXTS = [f"text number {i} " + "a" * (i % 7) for i in range(23)]


def embed_job(n: int = 10, **kw) -> EmbedJob:
    return EmbedJob(request_id="r1", model="m", input=TEXTS[:n], **kw)


def wav_bytes(frames: bytes, rate: int = 24000, channels: int = 1) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames)
    return buf.getvalue()


def read_wav(data: bytes) -> tuple[tuple[int, int, int], bytes]:
    with wave.open(io.BytesIO(data), "rb") as r:
        return (r.getnchannels(), r.getsampwidth(), r.getframerate()), r.readframes(r.getnframes())


# --- fake engines: a deterministic answer per item ----------------------------------------------------------


def fake_embed(job: EmbedJob) -> EmbedResult:
    rows = [struct.pack("<3f", len(t), sum(map(ord, t)) % 97, t.count("a")) for t in job.input]
    return EmbedResult(vectors=b"".join(rows), count=len(rows), dim=3)


def fake_rerank(job: RerankJob) -> RerankResult:
    return RerankResult(scores=[len(d) / (1 + len(job.query)) + d.count("a") for d in job.documents])


def fake_image(job: ImageJob) -> ImageResult:
    seeds = [job.seed + i for i in range(job.n)]
    return ImageResult(images=[Blob(data=f"png {job.prompt} {s}".encode()) for s in seeds], seeds=seeds)


def usage(i: int) -> Usage:
    return Usage(prompt_tokens=i, completion_tokens=2 * i, total_tokens=3 * i)


# --- chunking -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("items", range(1, 41))
def test_chunk_sizes_are_balanced_and_cover_every_item(items):
    for parts in range(1, items + 1):
        sizes = chunk_sizes(items, parts)
        assert len(sizes) == parts and sum(sizes) == items
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_group_sizes_are_non_empty_cover_everything_and_balance_weight():
    rng = random.Random(7)
    for n in range(1, 30):
        weights = [rng.randint(1, 200) for _ in range(n)]
        for parts in range(1, n + 1):
            sizes = group_sizes(weights, parts)
            assert len(sizes) == parts and sum(sizes) == n and min(sizes) >= 1
    assert group_sizes([10] * 6, 3) == [2, 2, 2]
    assert group_sizes([100, 1, 1, 1, 1, 100], 2) == [3, 3]
    assert group_sizes([300, 1, 1, 1], 2) == [1, 3]  # the long sentence stands alone


@pytest.mark.parametrize("items,hint,max_parts", list(itertools.product(range(1, 19), range(1, 11), (1, 2, 3, 8))))
def test_embed_plan_covers_input_once_in_order(items, hint, max_parts):
    job = embed_job(items, dimensions=64)
    p = plan("embed", job, hint, Distribute(max_parts=max_parts))
    want = min(hint, max_parts, items)
    if want < 2:
        assert p is None
        return
    assert len(p.jobs) == want and p.offsets == [0.0] * want
    assert [t for j in p.jobs for t in j.input] == job.input
    assert all(type(j) is EmbedJob and j.request_id == "r1" and j.dimensions == 64 and j.input for j in p.jobs)
    sizes = [len(j.input) for j in p.jobs]
    assert max(sizes) - min(sizes) <= 1


# --- when not to split --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op,job",
    [
        ("embed", embed_job(stream=True)),
        ("image", ImageJob(request_id="r", model="m", prompt="p", n=4, seed=1, stream=True)),
        ("speech", SpeechJob(request_id="r", model="m", input="One. Two. Three.", response_format="wav", stream=True)),
    ],
)
def test_streaming_jobs_are_not_split(op, job):
    assert plan(op, job, 4, ON) is None


def test_disabled_min_items_and_single_worker_do_not_split():
    assert plan("embed", embed_job(10), 4, Distribute(enabled=False)) is None
    assert plan("embed", embed_job(4), 4, Distribute(min_items=5)) is None
    assert plan("embed", embed_job(5), 4, Distribute(min_items=5)) is not None
    assert plan("embed", embed_job(1), 4, ON) is None
    assert plan("embed", embed_job(10), 1, ON) is None
    assert plan("embed", embed_job(10), 0, ON) is None
    assert plan("embed", embed_job(10), 4, Distribute(max_parts=1)) is None
    assert plan("image", ImageJob(request_id="r", model="m", prompt="p", n=1), 4, ON) is None


@pytest.mark.parametrize(
    "op,job",
    [
        ("chat", embed_job()),
        ("complete", embed_job()),
        ("video", VideoJob(request_id="r", model="m", prompt="p", num_frames=64)),
        ("diarize", DiarizeJob(request_id="r", model="m", audio=Blob(data=wav_bytes(b"\0\0" * 48000)))),
        ("train", embed_job()),
    ],
)
def test_other_ops_are_not_split(op, job):
    assert plan(op, job, 4, ON) is None


@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac", "aac"])
def test_speech_in_compressed_formats_is_not_split(fmt):
    job = SpeechJob(request_id="r", model="m", input="One. Two. Three. Four.", response_format=fmt)
    assert plan("speech", job, 4, ON) is None


def test_media_plans_without_readable_bytes_do_not_split():
    audio = TranscribeJob(request_id="r", model="m", audio=Blob(data=wav_bytes(b"\0\0" * 16000 * 100, 16000)))
    pdf = OcrJob(request_id="r", model="m", file=Blob(data=b"%PDF-1.4 whatever"))
    assert plan("transcribe", replace_audio(audio, Blob(name="stored", size=3)), 4, ON) is None
    assert plan("transcribe", replace_audio(audio, Blob(data=b"not audio at all")), 4, ON) is None
    assert plan("ocr", pdf, 4, ON) is None  # unreadable PDF: the engine reports it
    assert plan("ocr", OcrJob(request_id="r", model="m", file=Blob(data=b"\x89PNG\r\n\x1a\n...")), 4, ON) is None


def test_media_plans_degrade_to_no_split_without_their_library(monkeypatch):
    pytest.importorskip("av")
    pytest.importorskip("pypdfium2")
    audio = TranscribeJob(request_id="r", model="m", audio=Blob(data=wav_bytes(b"\0\0" * 16000 * 100, 16000)))
    pdf = OcrJob(request_id="r", model="m", file=Blob(data=five_page_pdf()))
    assert plan("transcribe", audio, 4, ON) is not None and plan("ocr", pdf, 4, ON) is not None
    monkeypatch.setitem(sys.modules, "av", None)  # import av now raises ImportError
    monkeypatch.setitem(sys.modules, "pypdfium2", None)
    assert plan("transcribe", audio, 4, ON) is None
    assert plan("ocr", pdf, 4, ON) is None


def replace_audio(job: TranscribeJob, blob: Blob) -> TranscribeJob:
    return msgspec.structs.replace(job, audio=blob)


# --- images, embeddings, rerank: merge reproduces the whole job -----------------------------------------------


def test_image_parts_get_contiguous_seed_offsets():
    job = ImageJob(request_id="r", model="m", prompt="cat", n=7, seed=100, width=64)
    p = plan("image", job, 3, ON)
    assert [(j.n, j.seed) for j in p.jobs] == [(3, 100), (2, 103), (2, 105)]
    assert all(j.prompt == "cat" and j.width == 64 and j.request_id == "r" for j in p.jobs)


@pytest.mark.parametrize("n,hint", list(itertools.product(range(2, 12), range(2, 9))))
def test_image_merge_equals_one_engine(n, hint):
    job = ImageJob(request_id="r", model="m", prompt="cat", n=n, seed=1000)
    p = plan("image", job, hint, ON)
    out, use = merge("image", job, p, [fake_image(j) for j in p.jobs], [usage(j.n) for j in p.jobs])
    assert out == fake_image(job)
    assert use == usage(n)


def test_image_without_seed_gets_one_base_seed_the_merge_reports():
    job = ImageJob(request_id="r", model="m", prompt="cat", n=5)
    p = plan("image", job, 2, ON)
    base = p.jobs[0].seed
    assert base is not None and [j.seed for j in p.jobs] == [base, base + 3]
    out, _ = merge("image", job, p, [fake_image(j) for j in p.jobs], [None, None])
    assert out == fake_image(msgspec.structs.replace(job, seed=base))
    # an engine that leaves seeds out still drew seed + i
    bare = [ImageResult(images=fake_image(j).images) for j in p.jobs]
    assert merge("image", job, p, bare, [None, None])[0].seeds == list(range(base, base + 5))


@pytest.mark.parametrize("items,hint", list(itertools.product(range(2, 24), (2, 3, 5, 8))))
def test_embed_merge_equals_one_engine(items, hint):
    job = embed_job(items)
    p = plan("embed", job, hint, ON)
    out, use = merge("embed", job, p, [fake_embed(j) for j in p.jobs], [usage(len(j.input)) for j in p.jobs])
    assert out == fake_embed(job)
    assert use == usage(items)


def test_embed_merge_rejects_mismatched_dims_and_counts():
    job = embed_job(4)
    p = plan("embed", job, 2, ON)
    good = [fake_embed(j) for j in p.jobs]
    wide = EmbedResult(vectors=b"\0" * 32, count=2, dim=4)
    with pytest.raises(MergeError, match="dimensions"):
        merge("embed", job, p, [good[0], wide], [None, None])
    with pytest.raises(MergeError, match="vectors"):
        merge("embed", job, p, [good[0], EmbedResult(vectors=b"\0" * 12, count=1, dim=3)], [None, None])


@pytest.mark.parametrize("items,hint", list(itertools.product(range(2, 24), (2, 3, 5, 8))))
def test_rerank_merge_equals_one_engine(items, hint):
    job = RerankJob(request_id="r", model="m", query="which one", documents=TEXTS[:items])
    p = plan("rerank", job, hint, ON)
    assert all(j.query == "which one" for j in p.jobs)
    assert [d for j in p.jobs for d in j.documents] == job.documents
    out, _ = merge("rerank", job, p, [fake_rerank(j) for j in p.jobs], [None] * len(p.jobs))
    assert out == fake_rerank(job)


def test_merge_rejects_wrong_count_type_and_op():
    job = embed_job(4)
    p = plan("embed", job, 2, ON)
    with pytest.raises(MergeError, match="answers for 2 parts"):
        merge("embed", job, p, [fake_embed(p.jobs[0])], [None])
    with pytest.raises(MergeError, match="RerankResult"):
        merge("embed", job, p, [fake_embed(p.jobs[0]), RerankResult(scores=[1.0, 2.0])], [None, None])
    with pytest.raises(MergeError, match="not an op"):
        merge("chat", job, p, [1, 2], [None, None])


# --- speech -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,sentences",
    [
        ("", []),
        ("no end mark at all", ["no end mark at all"]),
        ("One. Two! Three? Four", ["One.", "Two!", "Three?", "Four"]),
        ("Dr. Smith met Mrs. Jones. They talked.", ["Dr. Smith met Mrs. Jones.", "They talked."]),
        ("J. R. R. Tolkien wrote it. Yes.", ["J. R. R. Tolkien wrote it.", "Yes."]),
        ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
        ("Wait... What?! Pi is 3.14 exactly.", ["Wait...", "What?!", "Pi is 3.14 exactly."]),
        ("Use e.g. a fork. Or not.", ["Use e.g. a fork.", "Or not."]),
        ("A heading\n\nThe body text.", ["A heading", "The body text."]),
    ],
)
def test_split_sentences(text, sentences):
    assert fp.split_sentences(text) == sentences


SPEECH_TEXT = "The first sentence is here. Dr. Who answers! Is it short? " + " ".join(f"Line {i}." for i in range(9))


@pytest.mark.parametrize("fmt", ["wav", "pcm"])
def test_speech_plan_groups_sentences_in_order(fmt):
    job = SpeechJob(request_id="r", model="m", input=SPEECH_TEXT, voice="v", response_format=fmt, speed=1.5)
    p = plan("speech", job, 3, ON)
    assert len(p.jobs) == 3
    assert all(j.voice == "v" and j.response_format == fmt and j.speed == 1.5 and not j.stream for j in p.jobs)
    assert [s for j in p.jobs for s in fp.split_sentences(j.input)] == fp.split_sentences(SPEECH_TEXT)


def test_speech_wav_merge_concatenates_frames():
    job = SpeechJob(request_id="r", model="m", input=SPEECH_TEXT, response_format="wav")
    p = plan("speech", job, 3, ON)
    frames = [bytes([i]) * (200 * (i + 1)) for i in range(3)]
    outs = [
        SpeechResult(
            audio=Blob(data=wav_bytes(f), content_type="audio/wav"), sample_rate=24000, duration_s=len(f) / 2 / 24000
        )
        for f in frames
    ]
    out, _ = merge("speech", job, p, outs, [None] * 3)
    assert read_wav(out.audio.data) == ((1, 2, 24000), b"".join(frames))
    assert out.audio.content_type == "audio/wav" and out.audio.size == len(out.audio.data)
    assert out.sample_rate == 24000 and out.duration_s == pytest.approx(1200 / 2 / 24000)
    outs[2] = SpeechResult(audio=Blob(data=wav_bytes(frames[2], rate=22050)), sample_rate=22050)
    with pytest.raises(MergeError, match="different formats"):
        merge("speech", job, p, outs, [None] * 3)
    outs[2] = SpeechResult(audio=Blob(data=b"ID3 an mp3"), sample_rate=24000)
    with pytest.raises(MergeError, match="not a PCM WAV"):
        merge("speech", job, p, outs, [None] * 3)


def test_speech_pcm_merge_concatenates_bytes():
    job = SpeechJob(request_id="r", model="m", input=SPEECH_TEXT, response_format="pcm")
    p = plan("speech", job, 2, ON)
    outs = [
        SpeechResult(audio=Blob(data=b"ab" * 10, content_type="audio/pcm"), sample_rate=24000, duration_s=0.5),
        SpeechResult(audio=Blob(data=b"cd" * 5, content_type="audio/pcm"), sample_rate=24000, duration_s=0.25),
    ]
    out, use = merge("speech", job, p, outs, [usage(1), usage(2)])
    assert out.audio.data == b"ab" * 10 + b"cd" * 5 and out.duration_s == 0.75 and use == usage(3)


# --- transcription --------------------------------------------------------------------------------------------


def synthetic_speech(rate: int, silences: list[tuple[float, float]], total_s: float):
    """Loud tone everywhere except `silences` (start, end seconds), where only faint noise remains."""
    np = pytest.importorskip("numpy")
    t = np.arange(int(total_s * rate)) / rate
    x = 0.4 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 523 * t)
    for a, b in silences:
        x[int(a * rate) : int(b * rate)] = 0.0
    x += np.random.default_rng(0).normal(0, 0.001, len(x))
    return (x * 32767).astype("<i2")


SILENCES = [(10.0, 11.0), (29.0, 30.5), (45.0, 45.5), (70.0, 71.5), (85.0, 86.0)]


def test_silence_cuts_land_in_the_silence_nearest_each_ideal_point():
    pcm = synthetic_speech(16000, SILENCES, 100.0)
    cuts = fp.silence_cuts(pcm, 3)  # ideal 33.3 s and 66.7 s, searched +-6.7 s
    assert 29.0 < cuts[0] / 16000 < 30.5 and 70.0 < cuts[1] / 16000 < 71.5
    cuts = fp.silence_cuts(pcm, 2)  # ideal 50 s: 45.0-45.5 is the only silence within 40-60 s
    assert 45.0 < cuts[0] / 16000 < 45.5


def test_silence_cuts_without_silence_cut_near_the_ideal_points():
    np = pytest.importorskip("numpy")
    flat = np.zeros(16000 * 40, dtype="<i2")
    assert [abs(c - i) <= 800 for c, i in zip(fp.silence_cuts(flat, 4), (160000, 320000, 480000))] == [True] * 3
    for parts in range(2, 9):
        cuts = fp.silence_cuts(synthetic_speech(16000, [], 40.0), parts)
        assert len(cuts) == parts - 1 and cuts == sorted(set(cuts)) and 0 < cuts[0] and cuts[-1] < 16000 * 40


def test_transcribe_plan_cuts_inside_silences_and_reencodes_16k_wav():
    pytest.importorskip("av")
    pcm = synthetic_speech(24000, SILENCES, 100.0)  # 24 kHz: the plan resamples to 16 kHz itself
    job = TranscribeJob(
        request_id="r", model="m", audio=Blob(data=wav_bytes(pcm.tobytes(), 24000)), language="en", word_timestamps=True
    )
    p = plan("transcribe", job, 8, ON)  # 100 s holds three 30 s windows: three parts, not eight
    assert len(p.jobs) == 3 and p.offsets[0] == 0.0
    assert 29.0 < p.offsets[1] < 30.5 and 70.0 < p.offsets[2] < 71.5
    start = 0
    for j, off in zip(p.jobs, p.offsets):
        params, frames = read_wav(j.audio.data)
        assert params == (1, 2, 16000) and j.audio.content_type == "audio/wav"
        assert j.language == "en" and j.word_timestamps and j.request_id == "r"
        assert off == start / 16000
        start += len(frames) // 2
    assert abs(start - 100 * 16000) < 160
    short = TranscribeJob(request_id="r", model="m", audio=Blob(data=wav_bytes(pcm[: 24000 * 50].tobytes(), 24000)))
    assert plan("transcribe", short, 8, ON) is None  # under two 30 s windows


def seg(i: int, start: float, end: float, text: str) -> Segment:
    return Segment(id=i, start=start, end=end, text=text, words=[Word(word=text.strip(), start=start, end=end)])


def test_transcribe_merge_shifts_timestamps_and_renumbers():
    job = TranscribeJob(request_id="r", model="m", audio=Blob(data=b"x"))
    p = Plan(jobs=[job, job, job], offsets=[0.0, 29.75, 70.5])
    outs = [
        TranscribeResult(
            text=" Hello there. ",
            language="en",
            duration_s=29.75,
            segments=[seg(0, 0.0, 2.0, " Hello"), seg(1, 2.0, 29.0, " there.")],
        ),
        TranscribeResult(text="", language="de", duration_s=40.75),
        TranscribeResult(
            text="General Kenobi.", language="en", duration_s=29.5, segments=[seg(0, 0.5, 3.25, " General Kenobi.")]
        ),
    ]
    out, use = merge("transcribe", job, p, outs, [usage(1), None, usage(2)])
    assert out.text == "Hello there. General Kenobi." and out.language == "en" and out.duration_s == 100.0
    assert [(s.id, s.start, s.end) for s in out.segments] == [(0, 0.0, 2.0), (1, 2.0, 29.0), (2, 71.0, 73.75)]
    assert [(w.start, w.end) for w in out.segments[2].words] == [(71.0, 73.75)]
    assert use == usage(3)


def sound_per_window(windows: int):
    """The integration test's layout, with a tone for the phrase: per 30 s window, 2.6 s of sound from 0.5 s,
    then silence."""
    np = pytest.importorskip("numpy")
    t = np.arange(int(2.6 * 16000)) / 16000
    window = np.zeros(30 * 16000, dtype="<i2")
    window[8000 : 8000 + len(t)] = (0.4 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2")
    return np.tile(window, windows)


def fake_whisper(pcm, lead: float) -> TranscribeResult:
    """Whisper's shape of answer: one segment per 30 s window that holds sound, starting `lead` s after the
    window's start. Segment-level timestamps give lead 0; with word timestamps faster-whisper moves a segment's
    start to its first word's, and the untrained alignment heads of the tiny test whisper pile every word on
    the window's last frame (29.98 s), where the first-word clamp leaves it 1.4 s earlier: lead 28.58."""
    segments = []
    for w in range(0, len(pcm), 30 * 16000):
        if abs(pcm[w : w + 30 * 16000].astype(float)).max() > 0:
            start = round(w / 16000 + lead, 3)
            segments.append(
                Segment(
                    id=len(segments),
                    start=start,
                    end=round(w / 16000 + 29.98, 3),
                    text=" Hi.",
                    words=[Word(word="Hi.", start=start, end=round(w / 16000 + 29.98, 3))],
                )
            )
    return TranscribeResult(
        text="".join(s.text for s in segments).strip(), language="en", duration_s=len(pcm) / 16000, segments=segments
    )


@pytest.mark.parametrize("lead", [0.0, 28.58])
def test_transcribe_split_at_the_windows_merges_to_the_whole_answer(lead):
    """The reported [28.58, 58.58, 88.58] is not a wrong offset: the parts are cut exactly at 30 s and 60 s, on
    every planning, and when each part's own answer starts at 28.58 (as the whole engine's windows do), the
    merge is the whole answer."""
    pytest.importorskip("av")
    np = pytest.importorskip("numpy")
    pcm = sound_per_window(3)
    job = TranscribeJob(
        request_id="r", model="m", audio=Blob(data=wav_bytes(pcm.tobytes(), 16000)), word_timestamps=True
    )
    p = plan("transcribe", job, 3, ON)
    assert p.offsets == [0.0, 30.0, 60.0]
    assert [j.audio.data for j in plan("transcribe", job, 3, ON).jobs] == [j.audio.data for j in p.jobs]
    parts = [np.frombuffer(read_wav(j.audio.data)[1], "<i2") for j in p.jobs]
    assert all(np.array_equal(x, pcm[: 30 * 16000]) for x in parts)  # each part is one window, unshifted
    outs = [fake_whisper(x, lead) for x in parts]
    assert [s.start for o in outs for s in o.segments] == [lead] * 3  # each part's own times start at its 0
    out, _ = merge("transcribe", job, p, outs, [None] * 3)
    assert out == fake_whisper(pcm, lead)
    assert [s.start for s in out.segments] == [lead, round(30 + lead, 3), round(60 + lead, 3)]


# --- OCR ------------------------------------------------------------------------------------------------------


def five_page_pdf() -> bytes:
    image = pytest.importorskip("PIL.Image")
    pages = [image.new("RGB", (100 + 10 * i, 80), (i * 40, 0, 0)) for i in range(5)]
    buf = io.BytesIO()
    pages[0].save(buf, format="PDF", save_all=True, append_images=pages[1:])
    return buf.getvalue()


@pytest.mark.parametrize("hint,counts", [(2, [3, 2]), (3, [2, 2, 1]), (8, [1, 1, 1, 1, 1])])
def test_ocr_plan_splits_pdf_pages_in_order(hint, counts):
    pdfium = pytest.importorskip("pypdfium2")
    job = OcrJob(request_id="r", model="m", file=Blob(data=five_page_pdf(), content_type="application/pdf"))
    p = plan("ocr", job, hint, ON)
    widths = []
    for j, want in zip(p.jobs, counts):
        assert j.file.data.startswith(b"%PDF") and j.file.content_type == "application/pdf"
        doc = pdfium.PdfDocument(j.file.data)
        assert len(doc) == want
        widths += [round(doc[i].get_width()) for i in range(len(doc))]
        doc.close()
    assert len(p.jobs) == len(counts) and sum(counts) == 5
    assert widths == sorted(widths) and len(set(widths)) == 5  # pages kept their order


def test_ocr_merge_renumbers_pages():
    job = OcrJob(request_id="r", model="m", file=Blob(data=b"%PDF"))
    p = Plan(jobs=[job, job], offsets=[0.0, 0.0])
    outs = [
        OcrResult(pages=[OcrPage(index=i, width=10, height=10, text=f"a{i}") for i in range(3)]),
        OcrResult(pages=[OcrPage(index=i, width=10, height=10, text=f"b{i}") for i in range(2)]),
    ]
    out, _ = merge("ocr", job, p, outs, [None, None])
    assert [(pg.index, pg.text) for pg in out.pages] == [(0, "a0"), (1, "a1"), (2, "a2"), (3, "b0"), (4, "b1")]


def test_audio_past_the_bound_is_a_400_before_it_is_decoded_whole():
    """Attack: a small upload that decodes to hours of audio (gigabytes of samples in the gateway). Past the bound
    it is the client's 400, by the container's own length or by the samples decoded so far."""
    pytest.importorskip("av")
    from coderai.gateway.errors import ApiError

    silence = wav_bytes(b"\0\0" * 16000 * 3, rate=16000)  # 3 s
    assert len(fp._decode(silence, max_s=10)) == 16000 * 3
    with pytest.raises(ApiError) as exc:
        fp._decode(silence, max_s=1)
    assert (exc.value.status, exc.value.code, exc.value.param) == (400, "audio_too_long", "file")
