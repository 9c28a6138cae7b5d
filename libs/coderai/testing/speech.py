"""Speech for tests, spoken by espeak-ng (Debian package `espeak-ng`): single phrases and two-voice dialogues.

Audio is 16 kHz mono 16-bit WAV, what speech-to-text and diarization engines take without resampling.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import wave

import numpy as np

RATE = 16000
VOICES = ("en-us+m3", "en-us+f4")  # two voices far apart in pitch and timbre, for diarization


def have_espeak() -> bool:
    return shutil.which("espeak-ng") is not None


def speak_pcm(text: str, *, voice: str = "en-us", speed: int = 150, pitch: int = 50) -> np.ndarray:
    """`text` spoken by espeak-ng, as int16 samples at 16 kHz."""
    wav = subprocess.run(
        ["espeak-ng", "-v", voice, "-s", str(speed), "-p", str(pitch), "--stdout", text],
        check=True, capture_output=True,
    ).stdout
    with wave.open(io.BytesIO(wav)) as w:
        rate, frames = w.getframerate(), w.readframes(w.getnframes())
    samples = np.frombuffer(frames, dtype="<i2")
    if rate != RATE:  # espeak-ng speaks at 22,050 Hz: resample linearly, plenty for tests
        n = int(len(samples) * RATE / rate)
        samples = np.interp(np.linspace(0, len(samples) - 1, n), np.arange(len(samples)), samples).astype("<i2")
    return samples


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
