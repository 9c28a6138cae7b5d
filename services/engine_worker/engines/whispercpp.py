"""Speech-to-text with whisper.cpp (PyPI `pywhispercpp`'s bindings), in the worker's own process: transcription,
and translation into English.

`path`: a whisper.cpp ggml model file (f16 or quantized), such as `coderai.tiny_models.whisper_ggml.convert`
writes from a Hugging Face or CTranslate2 Whisper folder. It is checked before whisper.cpp opens it
(`inspect_ggml`): whisper.cpp answers a bad file with a null context that crashes the process at first use, and
an f32 one with an abort. The wheel's whisper.cpp runs on the CPU only.
`params`: `threads` (default min(4, cores), whisper.cpp's own default: its threads spin while they wait, so more
threads than free cores is many times slower, never faster), `max_audio_s` (longest upload accepted, default 4 h),
`beam_size` (beam search with that many beams, at most 8; default greedy), `best_of` (greedy candidates when
sampling, default 5), `condition_on_previous_text` (prompt each window with the text before it; default off, as
whisper.cpp's), `entropy_threshold`, `log_prob_threshold`, `no_speech_threshold` (when a window is decoded again
warmer, or called silence; whisper.cpp's 2.4, -1, 0.6 by default) and `suppress_non_speech`.

The OpenAI fields: `language` (an ISO-639-1 code among the model's; none: detected), `prompt` (whisper.cpp's
initial prompt), `temperature` (0: greedy, retried warmer 0.2 ... 1.0 when a window's text looks like a failure,
as OpenAI's; any other value samples at that temperature only), `task` translate, and word timestamps (from
whisper.cpp's token timestamps; words are tokens joined at the spaces that begin them). Uploads in any format
FFmpeg reads are decoded to 16 kHz float32 mono (`audio.decode`). A model that whisper.cpp decodes without
timestamp tokens (a first-release distilled Whisper: 2 decoder layers) gives one segment per 30-s window, and
word timestamps asked of it are refused with a 400. Not reported by whisper.cpp: `no_speech_prob` (0) and the
temperature a window's fallback used (the job's own is given).

Cancellation: whisper.cpp asks an abort callback between the steps of its graphs, so a cancelled job stops within
one encoder or decoder step and answers the segments it had. Jobs run one at a time: a whisper.cpp context holds
one decoding state. Usage counts the tokens the decoder produced as `completion_tokens` (timestamp tokens
included, prompt tokens 0), as the faster-whisper engine does.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import threading
import zlib
from collections.abc import Callable
from typing import Any

from coderai.contracts import ModelConfig, Usage
from coderai.contracts.media import Segment, TranscribeJob, TranscribeResult, Word
from coderai.engine_worker.engines import audio
from coderai.engine_worker.engines.base import BadInput, CancelFlag, Engine, EngineLoadError
from coderai.tiny_models.whisper_checkpoints import ConversionError
from coderai.tiny_models.whisper_ggml import GgmlInfo, inspect_ggml

Emit = Callable[..., None]
"""emit(progress=0..1)"""

log = logging.getLogger("coderai.engine_worker.whispercpp")

RATE = 16000
DEFAULT_MAX_AUDIO_S = 4 * 3600.0
FALLBACK_STEP = 0.2  # Whisper's own schedule for temperature 0: 0.2, 0.4 ... 1.0 after a failed greedy window
_ERROR = 4  # ggml's log level for errors
_load_errors = threading.local()  # what whisper.cpp logged as errors while this thread loaded a model
_routing = threading.Lock()
_routed = False


def _route_logs(pw: Any) -> None:
    """whisper.cpp's log lines into Python logging (once per process: the hook is global), errors kept for the
    load that is running on the same thread."""
    global _routed
    with _routing:
        if _routed:
            return
        _routed = True

    def hook(level: int, text: str) -> None:
        line = text.rstrip()
        if level == _ERROR:
            log.warning("whisper.cpp: %s", line)
            errors = getattr(_load_errors, "lines", None)
            if errors is not None:
                errors.append(line)
        elif line:
            log.debug("whisper.cpp: %s", line)

    pw.whisper_log_set(hook)
    # whisper.cpp logs while the process tears down too, when Python can no longer run the hook: that aborts
    atexit.register(pw.whisper_log_set, None)


def _number(config: ModelConfig, name: str, default: float, lo: float, hi: float) -> float:
    """A number param within [lo, hi] (whole when `default` is an int); a bad one fails the load, naming it."""
    try:
        value = config.param_int(name, default) if isinstance(default, int) else config.param_float(name, default)
    except (TypeError, ValueError) as exc:
        raise EngineLoadError(f"whispercpp param {name} must be a number, not {config.params.get(name)!r}") from exc
    if not lo <= value <= hi:
        raise EngineLoadError(f"whispercpp param {name} must be between {lo:g} and {hi:g}, not {value}")
    return value


def _clamp(value: float, lo: float, hi: float) -> float:
    return min(max(value, lo), hi)


class WhisperCppEngine(Engine):
    family = "whispercpp"
    max_concurrency = 1  # one decoding state per whisper.cpp context

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.pw: Any = None
        self.ctx: Any = None
        self.info: GgmlInfo | None = None
        self.languages: frozenset[str] = frozenset()

    def load(self) -> None:
        try:
            importlib.import_module("pywhispercpp")
            pw = importlib.import_module("_pywhispercpp")  # the compiled bindings, which pywhispercpp wraps
        except ImportError as exc:
            raise EngineLoadError("pywhispercpp is not installed: pip install 'coderai[whispercpp]'") from exc
        path = os.path.expanduser(self.config.path)
        if not os.path.isfile(path):
            raise EngineLoadError(f"not a whisper.cpp model file: {path}")
        try:
            info = inspect_ggml(path)
        except (ConversionError, OSError) as exc:
            raise EngineLoadError(str(exc)) from exc
        c = self.config
        self.threads = int(_number(c, "threads", min(4, os.cpu_count() or 1), 1, 1024))
        self.max_audio_s = _number(c, "max_audio_s", DEFAULT_MAX_AUDIO_S, 1, 7 * 86_400)
        self.beam_size = int(_number(c, "beam_size", 0, 0, 8))
        self.best_of = int(_number(c, "best_of", 5, 1, 8))
        self.entropy = _number(c, "entropy_threshold", 2.4, 0, 100)
        self.log_prob = _number(c, "log_prob_threshold", -1.0, -100, 100)
        self.no_speech = _number(c, "no_speech_threshold", 0.6, 0, 1)
        self.condition = c.param_bool("condition_on_previous_text")
        self.suppress_nst = c.param_bool("suppress_non_speech")
        _route_logs(pw)
        cparams = pw.whisper_context_default_params()
        cparams.use_gpu = False
        _load_errors.lines = []
        try:
            ctx = pw.whisper_init_from_file_with_params(path, cparams)
            errors = list(_load_errors.lines)
        finally:
            _load_errors.lines = None
        if errors:  # a failed load still hands back a context object, around a null pointer
            raise EngineLoadError(f"whisper.cpp could not load {path}: {errors[-1]}")
        self.pw, self.ctx, self.info = pw, ctx, info
        if info.multilingual:
            self.languages = frozenset(pw.whisper_lang_str(i) for i in range(info.n_languages))
        else:
            self.languages = frozenset({"en"})

    def close(self) -> None:
        if self.ctx is not None:
            self.pw.whisper_free(self.ctx)
            self.ctx = None

    def _params(self, job: TranscribeJob, language: str | None) -> Any:
        """Fresh whisper.cpp decoding params for `job` (a set is never reused: whisper.cpp keeps what it is given)."""
        pw = self.pw
        strategy = pw.whisper_sampling_strategy
        params = pw.whisper_full_default_params(
            strategy.WHISPER_SAMPLING_BEAM_SEARCH if self.beam_size else strategy.WHISPER_SAMPLING_GREEDY
        )
        if self.beam_size:
            params.beam_search = {"beam_size": self.beam_size, "patience": -1.0}
        else:
            params.greedy = {"best_of": self.best_of}
        params.n_threads = self.threads
        params.print_progress = False
        params.print_realtime = False
        params.print_timestamps = False
        params.language = language or ("" if self.info and self.info.multilingual else "en")  # "": detect it
        params.translate = job.task == "translate"
        if job.prompt:
            params.initial_prompt = job.prompt
        params.temperature = job.temperature
        params.temperature_inc = FALLBACK_STEP if job.temperature == 0 else 0.0
        params.token_timestamps = job.word_timestamps
        params.no_context = not self.condition
        params.entropy_thold = self.entropy
        params.logprob_thold = self.log_prob
        params.no_speech_thold = self.no_speech
        params.suppress_nst = self.suppress_nst
        return params

    def transcribe(
        self, job: TranscribeJob, cancel: CancelFlag, emit: Emit | None = None
    ) -> tuple[TranscribeResult, Usage]:
        """Text of `job.audio` in its own language (`task` transcribe) or in English (`task` translate), with
        timed segments and, when `word_timestamps` is set, timed words."""
        assert self.info is not None, "transcribe before load"
        language = audio.model_language(job.language, self.languages)  # before decoding: a bad field costs nothing
        if job.temperature < 0 or job.temperature > 1:
            raise BadInput(f"temperature must be between 0 and 1, not {job.temperature}", param="temperature")
        if job.word_timestamps and not self.info.timestamps:
            raise BadInput(
                f"model '{self.config.name}' (whispercpp) gives no timestamps: whisper.cpp decodes first-release "
                "distilled Whisper models (2 decoder layers) without them; ask for segment timestamps only",
                param="timestamp_granularities",
            )
        try:
            samples = audio.decode(job.audio.data, RATE, max_s=self.max_audio_s)
        except audio.AudioDecodeError as exc:
            raise BadInput(str(exc), param="file") from exc
        duration = samples.size / RATE
        pw, ctx = self.pw, self.ctx
        params = self._params(job, language)

        failed: list[Exception] = []  # raised in a callback: kept and raised here, never thrown through whisper.cpp

        def on_segment(_ctx: Any, n_new: int, _user: Any = None) -> None:
            try:
                if emit is not None and n_new > 0:
                    last = pw.whisper_full_get_segment_t1(ctx, pw.whisper_full_n_segments(ctx) - 1) / 100
                    emit(progress=_clamp(last / duration, 0.0, 1.0))
            except Exception as exc:  # noqa: BLE001 -- re-raised once whisper.cpp has returned
                failed.append(exc)

        pw.assign_new_segment_callback(params, on_segment)
        pw.assign_abort_callback(params, lambda: bool(cancel) or bool(failed))
        try:
            code = pw.whisper_full(ctx, params, samples, samples.size)
        finally:  # the bindings hold the callables (and through them this job) until told otherwise
            pw.assign_new_segment_callback(params, None)
            pw.assign_abort_callback(params, None)
        if failed:
            raise failed[0]
        if code != 0 and not cancel:
            raise RuntimeError(f"whisper.cpp failed to transcribe (code {code})")
        segments = self._segments(duration, job)
        produced = sum(len(s.tokens) for s in segments)
        detected = pw.whisper_lang_str(pw.whisper_full_lang_id(ctx)) if self.info.multilingual else "en"
        result = TranscribeResult(
            text="".join(s.text for s in segments).strip(),
            language=language or detected,
            duration_s=round(duration, 3),
            segments=segments,
        )
        return result, Usage(completion_tokens=produced, total_tokens=produced)

    def _segments(self, duration: float, job: TranscribeJob) -> list[Segment]:
        """whisper.cpp's segments as ours, times in seconds kept within the audio and in order (a model decoded
        without timestamps reports nonsense starts)."""
        pw, ctx = self.pw, self.ctx
        eot, beg = pw.whisper_token_eot(ctx), pw.whisper_token_beg(ctx)
        out: list[Segment] = []
        end = 0.0
        for i in range(pw.whisper_full_n_segments(ctx)):
            start = _clamp(pw.whisper_full_get_segment_t0(ctx, i) / 100, end, duration)
            end = _clamp(pw.whisper_full_get_segment_t1(ctx, i) / 100, start, duration)
            data = [pw.whisper_full_get_token_data(ctx, i, j) for j in range(pw.whisper_full_n_tokens(ctx, i))]
            kept = [t for t in data if t.id < eot or t.id >= beg]  # text and timestamps, not the task's tokens
            text = pw.whisper_full_get_segment_text(ctx, i).decode("utf-8", errors="replace")
            raw = text.encode()
            out.append(
                Segment(
                    id=i,
                    start=round(start, 3),
                    end=round(end, 3),
                    text=text,
                    avg_logprob=sum(float(t.plog) for t in kept) / len(kept) if kept else 0.0,
                    compression_ratio=len(raw) / len(zlib.compress(raw)) if raw else 0.0,
                    temperature=job.temperature,
                    tokens=[int(t.id) for t in kept],
                    words=self._words(data, eot, start, end) if job.word_timestamps else [],
                )
            )
        return out

    def _words(self, tokens: list[Any], eot: int, start: float, end: float) -> list[Word]:
        """Text tokens joined into words at the spaces that begin them (bytes first: a character may span two
        tokens), timed from whisper.cpp's token timestamps within the segment and in order."""
        groups: list[tuple[bytearray, list[float], list[float]]] = []  # bytes, [start, end], probabilities
        for t in tokens:
            if t.id >= eot:
                continue
            piece = self.pw.whisper_token_to_bytes(self.ctx, t.id)
            t0 = _clamp(t.t0 / 100, groups[-1][1][1] if groups else start, end)
            t1 = _clamp(t.t1 / 100, t0, end)
            if not groups or piece.startswith(b" "):
                groups.append((bytearray(piece), [t0, t1], [float(t.p)]))
            else:
                groups[-1][0].extend(piece)
                groups[-1][1][1] = t1
                groups[-1][2].append(float(t.p))
        return [
            Word(
                word=text.decode("utf-8", errors="replace"),
                start=round(span[0], 3),
                end=round(span[1], 3),
                probability=sum(probs) / len(probs),
            )
            for text, span, probs in groups
        ]


__all__ = ["WhisperCppEngine"]
