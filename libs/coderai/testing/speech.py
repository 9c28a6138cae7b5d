"""Speech for tests, spoken by espeak-ng (Debian package `espeak-ng`): single phrases and two-voice dialogues
(`speak_pcm` itself is coderai.tiny_models.speech, which the tiny Whisper builder uses).

Audio is 16 kHz mono 16-bit WAV, what speech-to-text and diarization engines take without resampling.
"""

from __future__ import annotations

import io
import shutil
import wave

import numpy as np

from coderai.tiny_models.speech import RATE, speak_pcm

VOICES = ("en-us+m3", "en-us+f4")  # two voices far apart in pitch and timbre, for diarization


def have_espeak() -> bool:
    return shutil.which("espeak-ng") is not None


def to_wav(samples: np.ndarray, rate: int = RATE) -> bytes:
    """int16 mono samples as WAV bytes."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.asarray(samples, dtype="<i2").tobytes())
    return buf.getvalue()


def speak(text: str, *, voice: str = "en-us", speed: int = 150, pitch: int = 50) -> bytes:
    """`text` spoken by espeak-ng as 16 kHz mono WAV bytes."""
    return to_wav(speak_pcm(text, voice=voice, speed=speed, pitch=pitch))


def dialogue(turns: list[tuple[str, str]], *, gap_s: float = 0.7) -> tuple[bytes, list[tuple[float, float, str]]]:
    """Turns of `(voice, text)` spoken one after another with `gap_s` of silence between them.

    Returns the WAV bytes and the truth: `(start_s, end_s, voice)` of each turn.
    """
    gap = np.zeros(int(gap_s * RATE), dtype="<i2")
    parts: list[np.ndarray] = [gap]
    truth: list[tuple[float, float, str]] = []
    t = gap_s
    for voice, text in turns:
        pitch = 30 if "+m" in voice else 75
        pcm = speak_pcm(text, voice=voice, pitch=pitch)
        truth.append((t, t + len(pcm) / RATE, voice))
        parts += [pcm, gap]
        t += len(pcm) / RATE + gap_s
    return to_wav(np.concatenate(parts)), truth
