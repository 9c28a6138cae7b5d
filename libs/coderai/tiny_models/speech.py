"""Speech spoken by espeak-ng (Debian package `espeak-ng`) as 16 kHz mono 16-bit samples: what the tiny Whisper
is overfitted on (coderai.tiny_models.whisper). Test helpers built on it are in coderai.testing.speech.
"""

from __future__ import annotations

import io
import subprocess
import wave

import numpy as np

RATE = 16000


def speak_pcm(text: str, *, voice: str = "en-us", speed: int = 150, pitch: int = 50) -> np.ndarray:
    """`text` spoken by espeak-ng, as int16 samples at 16 kHz."""
    wav = subprocess.run(
        ["espeak-ng", "-v", voice, "-s", str(speed), "-p", str(pitch), "--stdout", text],
        check=True,
        capture_output=True,
    ).stdout
    with wave.open(io.BytesIO(wav)) as w:
        rate, frames = w.getframerate(), w.readframes(w.getnframes())
    samples = np.frombuffer(frames, dtype="<i2")
    if rate != RATE:  # espeak-ng speaks at 22,050 Hz: resample linearly, plenty for tests
        n = int(len(samples) * RATE / rate)
        samples = np.interp(np.linspace(0, len(samples) - 1, n), np.arange(len(samples)), samples).astype("<i2")
    return samples
