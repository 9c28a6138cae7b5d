"""Speaker diarization (who spoke when): speaker-diarize-lite's pipeline, with Resemblyzer describing the voices.

speaker-diarize-lite finds speech by energy, cuts it into overlapping windows (1 s every 0.25 s by default),
clusters the windows' vectors and turns the clusters into turns; it decides the number of speakers itself, or
honours `num_speakers`. Its own hand-built spectral features merge similar voices, so each window is described by
Resemblyzer's speaker embedding instead (a small LSTM whose weights ship inside the wheel; nothing is downloaded).

`path`: empty, `builtin` or `resemblyzer` for Resemblyzer's built-in weights, else a Resemblyzer-format `.pt` file.
`params`: `device` (default cpu), `threads` (torch threads while diarizing, default 1), `max_audio_s` (longest
upload accepted, default 4 h), and the pipeline's own knobs `window_s`, `hop_s`, `min_segment_s`,
`min_speaker_s`, `max_speakers`, `separation_threshold`.

Uploads in any format FFmpeg reads are decoded to 16 kHz mono, what the embedding model was trained on.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from coderai.contracts import ModelConfig, Usage
from coderai.contracts.media import DiarizeJob, DiarizeResult, Turn
from coderai.engine_worker.engines import audio
from coderai.engine_worker.engines.base import BadInput, CancelFlag, Engine, EngineLoadError, torch_device

RATE = 16000
DEFAULT_MAX_AUDIO_S = 4 * 3600.0
# Resemblyzer was trained on utterances normalised to this loudness (its own preprocess_wav does the same)
TARGET_DBFS = -30.0
PIPELINE_PARAMS = ("window_s", "hop_s", "min_segment_s", "min_speaker_s", "max_speakers", "separation_threshold")


class _Cancelled(Exception):
    """Raised from inside the pipeline's per-window callback to stop a cancelled job early."""


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Run with `n` torch threads on this (the engine's own) thread, then put the old count back.

    The encoder is a 1.4M-parameter LSTM fed one window at a time: extra threads barely speed it up, and on a busy
    machine OpenMP's spinning workers make each call far slower (measured on a loaded 2-core box: 5 s a window
    with 2 threads, 20 ms with 1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class DiarizeEngine(Engine):
    family = "diarize"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.encoder: Any = None

    def load(self) -> None:
        try:
            from resemblyzer import VoiceEncoder
            from speaker_diarize_lite import Diarizer
        except ImportError as exc:
            raise EngineLoadError(
                "diarization needs resemblyzer and speaker-diarize-lite: pip install 'coderai[diarize]'"
            ) from exc
        params = dict(self.config.params)
        self.threads = self.config.param_int("threads", 1)
        self.max_audio_s = self.config.param_float("max_audio_s", DEFAULT_MAX_AUDIO_S)
        # The library's default separation (6.0) split one espeak-ng voice into two speakers within a 3 s
        # sentence; 8.0 kept every test dialogue right (2 voices -> 2, 1 -> 1) without merging distinct voices.
        self.options = {"separation_threshold": 8.0, **{k: params[k] for k in PIPELINE_PARAMS if k in params}}
        self._diarizer = Diarizer
        try:
            Diarizer(**self.options)  # reject bad knobs now, not on the first request
        except ValueError as exc:
            raise EngineLoadError(f"bad diarization params: {exc}") from exc
        path = self.config.path.strip()
        weights = None if path in ("", "builtin", "resemblyzer") else os.path.expanduser(path)
        if weights is not None and not os.path.isfile(weights):
            raise EngineLoadError(f"speaker-embedding weights not found: {weights}")
        try:
            with _torch_threads(self.threads):
                device = torch_device(self.config, self.config.param_str("device", "cpu"))
                self.encoder = (
                    VoiceEncoder(device, verbose=False)  # its built-in weights
                    if weights is None
                    else VoiceEncoder(device, verbose=False, weights_fpath=weights)
                )
        except Exception as exc:  # torch.load and Resemblyzer raise bare Exception and kin
            raise EngineLoadError(f"could not load the speaker-embedding model: {exc}") from exc

    def close(self) -> None:
        self.encoder = None

    def _embedder(self, cancel: CancelFlag) -> Callable[[np.ndarray, int], np.ndarray]:
        """The pipeline's per-window callback: a Resemblyzer embedding, or a stop once the caller has gone."""
        from resemblyzer.audio import normalize_volume

        def embed(window: np.ndarray, rate: int) -> np.ndarray:
            if cancel:
                raise _Cancelled
            wav = np.asarray(window, dtype=np.float32)
            if np.sqrt(np.mean(wav * wav)) > 1e-5:  # silence would be scaled by infinity
                wav = normalize_volume(wav, TARGET_DBFS, increase_only=True)
            return self.encoder.embed_utterance(wav)

        return embed

    def diarize(self, job: DiarizeJob, cancel: CancelFlag, emit: Any = None) -> tuple[DiarizeResult, Usage]:
        """Who spoke when in `job.audio`: turns labelled SPEAKER_00, SPEAKER_01, ... in order of first speech."""
        if job.num_speakers is not None and job.num_speakers < 1:
            raise BadInput(f"num_speakers must be at least 1, not {job.num_speakers}", param="num_speakers")
        try:
            samples = audio.decode(job.audio.data, RATE, max_s=self.max_audio_s)
        except audio.AudioDecodeError as exc:
            raise BadInput(str(exc), param="file") from exc
        duration = round(len(samples) / RATE, 3)
        usage = Usage(prompt_tokens=int(np.ceil(duration)), total_tokens=int(np.ceil(duration)))  # seconds heard
        pipeline = self._diarizer(num_speakers=job.num_speakers, embed=self._embedder(cancel), **self.options)
        try:
            with _torch_threads(self.threads):
                found = pipeline.diarize(samples, sample_rate=RATE)
        except _Cancelled:
            return DiarizeResult(segments=[], speakers=[], duration_s=duration), usage
        turns = [Turn(start=s.start_s, end=s.end_s, speaker=s.speaker) for s in found.segments]
        return DiarizeResult(segments=turns, speakers=found.speakers, duration_s=duration), usage


__all__ = ["DiarizeEngine"]
