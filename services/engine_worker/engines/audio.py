"""Audio in and out for the speech engines: int16 PCM to the OpenAI speech formats, any upload to float32.

Formats (`SpeechJob.response_format`) and what each produces:

| format | bytes                         | rate                 | encoded by                  |
|--------|-------------------------------|----------------------|-----------------------------|
| wav    | RIFF, 16-bit mono             | the voice's own      | here (header + samples)     |
| pcm    | raw 16-bit little-endian mono | 24 kHz, as OpenAI's  | here (libswresample via av) |
| mp3    | MPEG-1/2 layer III            | the voice's own      | PyAV (libmp3lame)           |
| opus   | Ogg Opus                      | 48 kHz (Opus's own)  | PyAV (libopus)              |
| aac    | ADTS (raw AAC frames)         | the voice's own      | PyAV (FFmpeg's aac)         |
| flac   | native FLAC                   | the voice's own      | PyAV (flac)                 |

ADTS rather than m4a for aac: an MP4 container writes its index at the end and must seek back, so it cannot be
streamed, while ADTS frames stand alone and play from any cut.

Every format streams. `encoder(fmt, rate)` gives an `Encoder` whose `write(pcm)` returns the bytes ready so far
and whose `finish()` returns the rest; their concatenation is a playable file. A streamed WAV carries 0xFFFFFFFF
as its sizes (the length is unknown when the header goes out; players read to the end). A streamed FLAC leaves
its total-samples field 0 (unknown) and a streamed MP3 has no Xing length header: both valid and FFmpeg plays
them, though libsndfile misreads a FLAC of unknown length (it reports a huge frame count). With
`streamed=False` the encoder may seek back in its own buffer, so WAV and FLAC carry exact lengths and MP3 a
Xing header; `write` then returns nothing and `finish` the whole file.
"""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np

from coderai.engine_worker.engines.base import BadInput

FORMATS = ("wav", "mp3", "opus", "flac", "aac", "pcm")
CONTENT_TYPES = {
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",  # an Ogg file: what browsers and players recognise, rather than audio/opus
    "flac": "audio/flac",
    "aac": "audio/aac",
    "pcm": "audio/pcm",
}
PCM_RATE = 24000  # OpenAI's pcm is 24 kHz 16-bit mono, and clients hard-code that
OPUS_RATE = 48000  # libopus takes 8/12/16/24/48 kHz; 48 kHz is what every Opus decoder outputs anyway

# (container format, codec, container options). Ogg pages default to 1 s, which would hold back up to a second
# of every streamed sentence; 100 ms pages cost a few bytes each.
_AV = {
    "mp3": ("mp3", "libmp3lame", {}),
    "opus": ("ogg", "libopus", {"page_duration": "100000"}),
    "aac": ("adts", "aac", {}),
    "flac": ("flac", "flac", {}),
}
_UNKNOWN = 0xFFFFFFFF


class AudioDecodeError(ValueError):
    """The bytes are not audio this machine's FFmpeg can read (engines answer it as BadInput on `file`)."""


def wav_header(rate: int, data_bytes: int | None = None, *, channels: int = 1, bits: int = 16) -> bytes:
    """A 44-byte PCM WAV header; `data_bytes=None` writes 0xFFFFFFFF sizes for a stream of unknown length."""
    block = channels * bits // 8
    data = _UNKNOWN if data_bytes is None else data_bytes
    riff = _UNKNOWN if data_bytes is None else 36 + data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, rate, rate * block, block, bits)
        + b"data"
        + struct.pack("<I", data)
    )


class Encoder:
    """Incremental encoder of int16 mono PCM. `rate` is the sample rate of the bytes it produces."""

    fmt = ""
    rate = 0

    @property
    def content_type(self) -> str:
        return CONTENT_TYPES[self.fmt]

    def write(self, pcm: np.ndarray) -> bytes:
        """Encode more samples; returns the bytes that are ready (maybe none)."""
        raise NotImplementedError

    def finish(self) -> bytes:
        """Flush the encoder; returns the remaining bytes. The encoder cannot be used afterwards."""
        raise NotImplementedError


def encoder(fmt: str, rate: int, *, streamed: bool = True) -> Encoder:
    """An `Encoder` to `fmt` (one of `FORMATS`) of int16 mono samples at `rate` Hz."""
    if fmt == "wav":
        return _WavEncoder(rate, streamed)
    if fmt == "pcm":
        return _PcmEncoder(rate, streamed)
    if fmt in _AV:
        return _AvEncoder(fmt, rate, streamed)
    raise ValueError(f"unknown audio format {fmt!r}; one of {', '.join(FORMATS)}")


def encode(pcm: np.ndarray, rate: int, fmt: str) -> bytes:
    """All of `pcm` (int16 mono at `rate` Hz) as one `fmt` file."""
    enc = encoder(fmt, rate, streamed=False)
    return enc.write(pcm) + enc.finish()


def output_rate(fmt: str, rate: int) -> int:
    """The sample rate of `fmt` bytes made from audio at `rate` Hz."""
    return {"pcm": PCM_RATE, "opus": OPUS_RATE}.get(fmt, rate)


def _int16(pcm: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(pcm).reshape(-1), dtype="<i2")


class _WavEncoder(Encoder):
    fmt = "wav"

    def __init__(self, rate: int, streamed: bool) -> None:
        self.rate = rate
        self.streamed = streamed
        self._parts: list[bytes] = []
        self._header_sent = False

    def write(self, pcm: np.ndarray) -> bytes:
        data = _int16(pcm).tobytes()
        if not self.streamed:
            self._parts.append(data)
            return b""
        if not self._header_sent:
            self._header_sent = True
            return wav_header(self.rate) + data
        return data

    def finish(self) -> bytes:
        if self.streamed:
            return b"" if self._header_sent else wav_header(self.rate)
        data = b"".join(self._parts)
        return wav_header(self.rate, len(data)) + data


def _frame(pcm: np.ndarray, rate: int) -> Any:
    import av

    frame = av.AudioFrame.from_ndarray(_int16(pcm)[None, :], format="s16", layout="mono")
    frame.sample_rate = rate
    return frame


class _PcmEncoder(Encoder):
    """Raw samples at 24 kHz; resampled through libswresample, which keeps its filter state across writes."""

    fmt = "pcm"
    rate = PCM_RATE

    def __init__(self, rate: int, streamed: bool) -> None:
        import av

        self.in_rate = rate
        self.streamed = streamed
        self._held: list[bytes] = []
        self._resampler = None if rate == PCM_RATE else av.AudioResampler(format="s16", layout="mono", rate=PCM_RATE)

    def _out(self, frames: list[Any]) -> bytes:
        return b"".join(f.to_ndarray().astype("<i2").tobytes() for f in frames)

    def _convert(self, pcm: np.ndarray) -> bytes:
        if self._resampler is None:
            return _int16(pcm).tobytes()
        return self._out(self._resampler.resample(_frame(pcm, self.in_rate))) if len(pcm) else b""

    def write(self, pcm: np.ndarray) -> bytes:
        data = self._convert(pcm)
        if self.streamed:
            return data
        self._held.append(data)
        return b""

    def finish(self) -> bytes:
        tail = b"" if self._resampler is None else self._out(self._resampler.resample(None))
        return b"".join(self._held) + tail


class _Sink:
    """A write-only file for PyAV: without `seek` FFmpeg treats the output as a stream and never goes back."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def write(self, data: bytes) -> int:
        self.buf += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self.buf)
        self.buf.clear()
        return out


class _AvEncoder(Encoder):
    def __init__(self, fmt: str, rate: int, streamed: bool) -> None:
        import av

        self.fmt = fmt
        self.in_rate = rate
        self.rate = output_rate(fmt, rate)
        self.streamed = streamed
        container, codec, options = _AV[fmt]
        self._file: Any = _Sink() if streamed else io.BytesIO()
        self._out = av.open(self._file, "w", format=container, options=dict(options))
        # PyAV resamples and re-frames each input frame to what the codec wants (format, rate, frame size)
        self._stream = self._out.add_stream(codec, rate=self.rate, layout="mono")

    def _mux(self, frame: Any) -> bytes:
        for packet in self._stream.encode(frame):
            self._out.mux(packet)
        return self._file.take() if self.streamed else b""

    def write(self, pcm: np.ndarray) -> bytes:
        if len(pcm) == 0:
            return b""
        return self._mux(_frame(pcm, self.in_rate))

    def finish(self) -> bytes:
        tail = self._mux(None)
        self._out.close()
        return tail + self._file.take() if self.streamed else self._file.getvalue()


def decode(data: bytes, rate: int = 16000, *, max_s: float | None = None) -> np.ndarray:
    """Any audio (or video with sound) FFmpeg reads, as float32 mono samples at `rate` Hz.

    Raises AudioDecodeError when the bytes hold no readable audio, or more than `max_s` seconds of it.
    """
    import av
    from av.error import FFmpegError

    if not data:
        raise AudioDecodeError("the file is empty")
    limit = None if max_s is None else int(max_s * rate)
    parts: list[np.ndarray] = []
    total = 0
    try:
        with av.open(io.BytesIO(data), "r") as container:
            if not container.streams.audio:
                raise AudioDecodeError("the file has no audio track")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            for frame in container.decode(audio=0):
                for out in resampler.resample(frame):
                    parts.append(out.to_ndarray().reshape(-1))
                    total += parts[-1].size
                if limit is not None and total > limit:
                    raise AudioDecodeError(f"the audio is longer than the {max_s:g} s this model accepts")
            parts += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    except AudioDecodeError:
        raise
    except (FFmpegError, ValueError, EOFError) as exc:  # ValueError: a stream whose format changes midway
        reason = getattr(exc, "strerror", None) or str(exc)  # FFmpeg's words, without its errno and file name
        raise AudioDecodeError(f"the file is not audio that can be decoded ({reason})") from exc
    samples = np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)
    if samples.size == 0:
        raise AudioDecodeError("the file holds no audio samples")
    return samples


def model_language(requested: str | None, languages: frozenset[str]) -> str | None:
    """A transcription job's language as the model's code (`languages`: the codes it knows), None to detect it;
    BadInput on `language` when the model has no such code."""
    if requested is None or not requested.strip():
        return None
    code = requested.strip().lower()
    if code not in languages:
        if languages == {"en"}:
            raise BadInput(
                f"language {requested!r} is not available: this model is English-only ('en').", param="language"
            )
        raise BadInput(
            f"language {requested!r} is not a language this model knows; give an ISO-639-1 "
            "code such as 'en', 'fr' or 'de', or leave it out to have the language detected.",
            param="language",
        )
    return code
