"""Speech-to-text with faster-whisper (Whisper on CTranslate2): transcription, and translation into English.

`path`: a CTranslate2 Whisper folder (`model.bin`, `tokenizer.json`, `preprocessor_config.json`), as
`ct2-transformers-converter --copy_files tokenizer.json preprocessor_config.json` writes it. Nothing is fetched:
faster-whisper takes any path that is not a folder for a hub model name, and reaches for the hub's tokenizer
when the folder has none, so both are refused at load.
`params`: `device` (default cpu), `compute_type` (default int8), `threads` (CPU threads, default all cores),
`workers` (jobs transcribed side by side, each with its own CTranslate2 worker; default 1), `max_audio_s`
(longest upload accepted, default 4 h), and faster-whisper's decoding knobs listed in `DECODE_PARAMS`
(`beam_size` 5, `vad_filter` off, ... by default).

Uploads in any format FFmpeg reads are decoded to 16 kHz mono. `temperature` 0 means what it means to OpenAI:
start greedy and retry warmer (0.2 ... 1.0) when a window's text looks like a failure (repetitive or
improbable); any other value samples at that temperature only. The job is checked for cancellation between
segments. Usage counts the tokens the decoder produced as `completion_tokens` (timestamp tokens included, prompt
tokens 0): the work done, where the audio's length is already in `duration_s`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, overload

from coderai.contracts import ModelConfig, Usage
from coderai.contracts.media import Segment, TranscribeJob, TranscribeResult, Word
from coderai.engine_worker.engines import audio
from coderai.engine_worker.engines.base import BadInput, CancelFlag, Engine, EngineLoadError

Emit = Callable[..., None]
"""emit(progress=0..1)"""

RATE = 16000
DEFAULT_MAX_AUDIO_S = 4 * 3600.0
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # Whisper's own schedule, what OpenAI's temperature 0 uses
DECODE_PARAMS = (
    "beam_size",
    "best_of",
    "patience",
    "length_penalty",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "compression_ratio_threshold",
    "log_prob_threshold",
    "no_speech_threshold",
    "condition_on_previous_text",
    "vad_filter",
    "vad_parameters",
    "hallucination_silence_threshold",
    "chunk_length",
)


@overload
def _param(config: ModelConfig, name: str, default: int) -> int: ...
@overload
def _param(config: ModelConfig, name: str, default: float) -> float: ...
def _param(config: ModelConfig, name: str, default: float) -> float:
    """A positive number from the model's params (a whole one when `default` is an int); a bad one fails the load,
    naming it."""
    try:
        value = config.param_int(name, default) if isinstance(default, int) else config.param_float(name, default)
    except (TypeError, ValueError) as exc:
        raise EngineLoadError(f"whisper param {name} must be a number, not {config.params.get(name)!r}") from exc
    if value <= 0:
        raise EngineLoadError(f"whisper param {name} must be positive, not {value}")
    return value


class WhisperEngine(Engine):
    family = "whisper"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        # read before load: the worker sizes this engine's thread pool from it
        self.max_concurrency = _param(config, "workers", 1)
        self.model: Any = None
        self.languages: frozenset[str] = frozenset()

    def load(self) -> None:
        try:
            from faster_whisper import WhisperModel
        except ImportError as exc:
            raise EngineLoadError("faster-whisper is not installed: pip install 'coderai[whisper]'") from exc
        path = os.path.expanduser(self.config.path)
        if not os.path.isfile(os.path.join(path, "model.bin")):
            raise EngineLoadError(f"not a CTranslate2 Whisper folder (no model.bin): {path}")
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise EngineLoadError(
                f"no tokenizer.json in {path}: convert with --copy_files tokenizer.json preprocessor_config.json"
            )
        params = dict(self.config.params)
        threads = _param(self.config, "threads", os.cpu_count() or 1)
        self.max_audio_s = _param(self.config, "max_audio_s", DEFAULT_MAX_AUDIO_S)
        self.options = {k: params[k] for k in DECODE_PARAMS if k in params}
        # the GPU the scheduler gave this copy, else the `device` param (faster-whisper's device_index defaults to 0)
        device, index = (
            ("cuda", self.config.devices[0]) if self.config.devices else (self.config.param_str("device", "cpu"), 0)
        )
        try:
            self.model = WhisperModel(
                path,
                device=device,
                device_index=index,
                compute_type=self.config.param_str("compute_type", "int8"),
                cpu_threads=threads,
                num_workers=self.max_concurrency,
                local_files_only=True,
            )
        except (RuntimeError, ValueError, OSError) as exc:
            raise EngineLoadError(f"faster-whisper could not load {path}: {exc}") from exc
        if self.model.model.is_multilingual:
            # faster-whisper lists every code it knows; a model has tokens for 99 or 100 of them
            tok = self.model.hf_tokenizer
            self.languages = frozenset(
                c for c in self.model.supported_languages if tok.token_to_id(f"<|{c}|>") is not None
            )
        else:
            self.languages = frozenset({"en"})

    def close(self) -> None:
        self.model = None

    def transcribe(
        self, job: TranscribeJob, cancel: CancelFlag, emit: Emit | None = None
    ) -> tuple[TranscribeResult, Usage]:
        """Text of `job.audio` in its own language (`task` transcribe) or in English (`task` translate), with
        timed segments and, when `word_timestamps` is set, timed words."""
        language = audio.model_language(job.language, self.languages)  # before decoding: a bad field costs nothing
        if job.temperature < 0 or job.temperature > 1:
            raise BadInput(f"temperature must be between 0 and 1, not {job.temperature}", param="temperature")
        try:
            samples = audio.decode(job.audio.data, RATE, max_s=self.max_audio_s)
        except audio.AudioDecodeError as exc:
            raise BadInput(str(exc), param="file") from exc
        pieces, info = self.model.transcribe(
            samples,
            task=job.task,
            language=language,
            initial_prompt=job.prompt or None,
            temperature=job.temperature if job.temperature > 0 else FALLBACK_TEMPERATURES,
            word_timestamps=job.word_timestamps,
            **self.options,
        )
        segments: list[Segment] = []
        for piece in pieces:  # a generator: each window is decoded only when asked for
            segments.append(_segment(len(segments), piece))
            if emit is not None and info.duration > 0:
                emit(progress=min(1.0, piece.end / info.duration))
            if cancel:
                break
        produced = sum(len(s.tokens) for s in segments)
        result = TranscribeResult(
            text="".join(s.text for s in segments).strip(),
            language=info.language,
            duration_s=round(float(info.duration), 3),
            segments=segments,
        )
        return result, Usage(completion_tokens=produced, total_tokens=produced)


def _segment(index: int, s: Any) -> Segment:
    """faster-whisper's segment as ours, numbered from 0 as OpenAI numbers them (faster-whisper counts from 1)."""
    words = [
        Word(word=w.word, start=round(float(w.start), 3), end=round(float(w.end), 3), probability=float(w.probability))
        for w in (s.words or [])
    ]
    return Segment(
        id=index,
        start=round(float(s.start), 3),
        end=round(float(s.end), 3),
        text=s.text,
        avg_logprob=float(s.avg_logprob),
        no_speech_prob=float(s.no_speech_prob),
        compression_ratio=float(s.compression_ratio),
        temperature=float(s.temperature or 0.0),
        tokens=[int(t) for t in s.tokens],
        words=words,
    )


__all__ = ["WhisperEngine"]
