"""Fan-out of audio: speech by sentences (the audio joined), transcription by audio cut at silences (timestamps
shifted). Pure functions like `plans.py`, whose table names them; PyAV and numpy are imported lazily."""

from __future__ import annotations

import io
import itertools
import re
import wave
from collections.abc import Callable
from typing import TYPE_CHECKING

from msgspec.structs import replace

from coderai.contracts.media import Blob, SpeechJob, SpeechResult, TranscribeJob, TranscribeResult
from coderai.gateway.errors import ApiError
from coderai.gateway.fanout.parts import MergeError, Plan

if TYPE_CHECKING:
    import numpy as np

STT_RATE = 16000  # what Whisper-family models resample to anyway, so pieces lose nothing they would have kept
STT_PIECE_S = 30.0  # Whisper decodes 30 s windows: a shorter piece costs a whole window and loses context
_SEARCH = 0.2  # a cut may move this fraction of a piece's length either way to land in a silence
_WINDOW_S, _HOP_S = 0.1, 0.01
MAX_AUDIO_S = 4 * 3600.0  # the longest upload the gateway decodes to cut (an engine's own default bound too)

# --- speech: sentences in, audio joined ---------------------------------------------------------------------------

# an end mark (with closing quotes or brackets) then whitespace, or a blank line (a heading, a list item)
_SENTENCE_END = re.compile(r"([.!?\u2026]+)[\"'\u201d\u2019)\]]*(?:\s+|$)|\n\s*\n")
_ABBREVIATIONS = frozenset("mr mrs ms dr prof sr jr st mt vs etc e.g i.e cf no fig approx dept inc ltd".split())


def split_sentences(text: str) -> list[str]:
    """The sentences of `text`, punctuation kept, whitespace stripped; "Dr." and initials ("J. Smith") end none."""
    out: list[str] = []
    start = 0
    for m in _SENTENCE_END.finditer(text):
        if m.group(1) == "." and m.end() < len(text):
            words = text[start : m.start()].split()
            last = words[-1].lstrip("(\"'\u201c\u2018").lower() if words else ""
            if last in _ABBREVIATIONS or (len(last) == 1 and last.isalpha()):
                continue
        if piece := text[start : m.end()].strip():
            out.append(piece)
        start = m.end()
    if tail := text[start:].strip():
        out.append(tail)
    return out


def group_sizes(weights: list[int], parts: int) -> list[int]:
    """Sizes of `parts` contiguous non-empty groups of `weights` whose sums are as even as whole items allow."""
    cum = [0, *itertools.accumulate(weights)]
    cuts, prev = [0], 0
    for k in range(1, parts):
        target = cum[-1] * k / parts
        # leave at least one item for each group still to come
        prev = min(range(prev + 1, len(weights) - (parts - k) + 1), key=lambda j: abs(cum[j] - target))
        cuts.append(prev)
    cuts.append(len(weights))
    return [b - a for a, b in itertools.pairwise(cuts)]


def plan_speech(job: SpeechJob, count: Callable[[int], int]) -> Plan | None:
    # wav joins exactly; pcm (resampled to 24 kHz by each part's engine) joins with under a sample of phase shift
    # per cut, in the silence between sentences; compressed formats would need re-encoding, and their frames click
    if job.response_format not in ("wav", "pcm"):
        return None
    sentences = split_sentences(job.input)
    k = count(len(sentences))
    if not k:
        return None
    # TTS time follows text length, so groups are balanced by characters rather than by sentence count
    jobs, start = [], 0
    for size in group_sizes([len(s) for s in sentences], k):
        jobs.append(replace(job, input=" ".join(sentences[start : start + size]), stream=False))
        start += size
    return Plan(jobs, [0.0] * k)


def _join_wav(parts: list[bytes]) -> bytes:
    params, frames = None, []
    try:
        for data in parts:
            with wave.open(io.BytesIO(data), "rb") as r:
                p = (r.getnchannels(), r.getsampwidth(), r.getframerate())
                if params is not None and p != params:
                    raise MergeError(f"speech: parts in different formats {params} and {p}")
                params = p
                frames.append(r.readframes(r.getnframes()))
    except (wave.Error, EOFError) as e:
        raise MergeError(f"speech: a part is not a PCM WAV: {e}") from e
    if params is None:
        raise MergeError("speech: no parts to join")
    return _wav(b"".join(frames), params[2], channels=params[0], width=params[1])


def _wav(frames: bytes, rate: int, *, channels: int = 1, width: int = 2) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setparams((channels, width, rate, 0, "NONE", "not compressed"))
        w.writeframes(frames)
    return buf.getvalue()


def merge_speech(job: SpeechJob, plan: Plan, outputs: list[SpeechResult]) -> SpeechResult:
    audios = [o.audio for o in outputs if o.audio is not None and (o.audio.data or not o.audio.name)]
    if len(audios) != len(outputs):
        raise MergeError("speech: every part's audio must be inline bytes (fetch stored blobs before merging)")
    data = b"".join(a.data for a in audios) if job.response_format == "pcm" else _join_wav([a.data for a in audios])
    audio = replace(audios[0], data=data, size=len(data), name="")
    return SpeechResult(audio=audio, sample_rate=outputs[0].sample_rate, duration_s=sum(o.duration_s for o in outputs))


# --- transcription: audio cut at silences, timestamps shifted -----------------------------------------------------


def _too_long(seconds: float, max_s: float) -> ApiError:
    return ApiError(
        400,
        f"The audio is over {seconds:.0f} s long; at most {max_s:.0f} s are transcribed.",
        param="file",
        code="audio_too_long",
    )


def _decode(data: bytes, max_s: float = MAX_AUDIO_S) -> np.ndarray | None:
    """`data` (any container ffmpeg reads) as int16 mono at STT_RATE, or None where it cannot be decoded. Past
    `max_s` of audio a 400: by the length the container says before anything is decoded, and by the samples as
    they come (a small file of silence can decode to gigabytes, whatever its header claims)."""
    import av
    import av.error
    import numpy as np

    chunks, samples, limit = [], 0, int(max_s * STT_RATE)
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if container.duration and container.duration / av.time_base > max_s:
                raise _too_long(container.duration / av.time_base, max_s)
            resampler = av.AudioResampler(format="s16", layout="mono", rate=STT_RATE)
            for frame in container.decode(container.streams.audio[0]):
                new = [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
                chunks += new
                samples += sum(len(c) for c in new)
                if samples > limit:
                    raise _too_long(samples / STT_RATE, max_s)
            chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    except (av.error.FFmpegError, IndexError, ValueError):
        return None  # the engine gets the whole upload and reports the error in its own words
    return np.concatenate(chunks).astype("<i2") if chunks else None


def silence_cuts(pcm: np.ndarray, parts: int, rate: int = STT_RATE) -> list[int]:
    """`parts - 1` sample indices that cut `pcm` into pieces of roughly equal length, each at the quietest 100 ms
    window within +-20% of a piece's length from its ideal point (the nearest such window on a tie)."""
    import numpy as np

    hop, per_window = int(rate * _HOP_S), round(_WINDOW_S / _HOP_S)
    n_blocks = len(pcm) // hop
    energy = np.empty(n_blocks)
    step = 4096  # blocks per slice: bounds the float copies for hour-long uploads
    for i in range(0, n_blocks, step):
        b = pcm[i * hop : min(i + step, n_blocks) * hop].reshape(-1, hop).astype(np.float32) / 32768.0
        energy[i : i + len(b)] = np.einsum("ij,ij->i", b, b)
    cs = np.concatenate(([0.0], np.cumsum(energy)))
    windows = cs[per_window:] - cs[:-per_window] if n_blocks >= per_window else np.zeros(0)
    centres = np.arange(len(windows)) * hop + hop * per_window // 2
    piece = len(pcm) / parts
    cuts, prev = [], 0
    for k in range(1, parts):
        ideal = k * piece
        sel = np.nonzero((centres > max(prev, ideal - _SEARCH * piece)) & (centres < ideal + _SEARCH * piece))[0]
        if sel.size:
            best = sel[np.lexsort((np.abs(centres[sel] - ideal), windows[sel]))[0]]
            prev = int(centres[best])
        else:
            prev = int(ideal)
        cuts.append(prev)
    return cuts


def plan_transcribe(job: TranscribeJob, count: Callable[[int], int]) -> Plan | None:
    if not job.audio.data:
        return None  # stored by name: the engine fetches it; cutting it here would mean fetching it twice
    try:
        pcm = _decode(job.audio.data)
    except ImportError:
        return None
    if pcm is None:
        return None
    k = count(int(len(pcm) / STT_RATE // STT_PIECE_S))
    if not k:
        return None
    bounds = [0, *silence_cuts(pcm, k), len(pcm)]
    jobs = []
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        data = _wav(pcm[a:b].tobytes(), STT_RATE)
        jobs.append(
            replace(job, audio=Blob(data=data, size=len(data), content_type="audio/wav", filename=f"part-{i}.wav"))
        )
    return Plan(jobs, [a / STT_RATE for a in bounds[:-1]])


def merge_transcribe(job: TranscribeJob, plan: Plan, outputs: list[TranscribeResult]) -> TranscribeResult:
    segments = []
    for off, out in zip(plan.offsets, outputs):
        for s in out.segments:
            # milliseconds, like the engine's own timestamps (and no 12.340000000000002 from the float offset)
            words = [replace(w, start=round(w.start + off, 3), end=round(w.end + off, 3)) for w in s.words]
            segments.append(
                replace(s, id=len(segments), start=round(s.start + off, 3), end=round(s.end + off, 3), words=words)
            )
    text = " ".join(t for t in (o.text.strip() for o in outputs) if t)
    return TranscribeResult(
        text=text, language=outputs[0].language, duration_s=sum(o.duration_s for o in outputs), segments=segments
    )
