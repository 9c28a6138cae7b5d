"""The speech engines' codec: int16 PCM to every OpenAI speech format, whole and streamed; uploads back to floats."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np
import pytest

from coderai.engine_worker.engines import audio

av = pytest.importorskip("av")
sf = pytest.importorskip("soundfile")

RATE = 22050  # Piper's usual rate: not one any codec is built around, so resampling paths get exercised
SECONDS = 2.5


def tone(seconds: float = SECONDS, rate: int = RATE, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (np.sin(2 * np.pi * hz * t) * 12000).astype(np.int16)


def av_probe(data: bytes) -> tuple[str, int, float]:
    """(codec, sample rate, seconds) of the first audio stream, by decoding every frame."""
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.audio[0]
        samples = sum(f.samples for f in c.decode(stream))
        return stream.codec_context.name, stream.codec_context.sample_rate, samples / stream.codec_context.sample_rate


def streamed(fmt: str, pcm: np.ndarray, piece: int = 5000) -> tuple[list[bytes], audio.Encoder]:
    enc = audio.encoder(fmt, RATE)
    parts = [enc.write(pcm[i : i + piece]) for i in range(0, len(pcm), piece)]
    return parts + [enc.finish()], enc


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_lossless_formats_round_trip_exactly_through_libsndfile(fmt):
    pcm = tone()
    data = audio.encode(pcm, RATE, fmt)
    back, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == RATE
    assert np.array_equal(back, pcm)


@pytest.mark.parametrize("fmt,codec,rate", [("mp3", "mp3", RATE), ("opus", "opus", 48000), ("aac", "aac", RATE)])
def test_lossy_formats_decode_with_the_right_codec_rate_and_length(fmt, codec, rate):
    data = audio.encode(tone(), RATE, fmt)
    name, got_rate, seconds = av_probe(data)
    assert name.startswith(codec) and got_rate == rate == audio.output_rate(fmt, RATE)
    assert SECONDS - 0.05 <= seconds <= SECONDS + 0.15  # encoders pad by up to a frame or two


def test_pcm_is_24khz_16bit_little_endian():
    pcm = tone()
    data = audio.encode(pcm, RATE, "pcm")
    assert len(data) % 2 == 0
    samples = np.frombuffer(data, "<i2")
    assert abs(len(samples) / audio.PCM_RATE - SECONDS) < 0.01
    spectrum = np.abs(np.fft.rfft(samples.astype(np.float64)))
    assert abs(np.argmax(spectrum) * audio.PCM_RATE / len(samples) - 440) < 2  # the tone survived resampling


def test_pcm_at_24khz_passes_through_untouched():
    pcm = tone(rate=audio.PCM_RATE)
    assert audio.encode(pcm, audio.PCM_RATE, "pcm") == pcm.astype("<i2").tobytes()


def test_streamed_wav_is_a_header_then_samples_and_plays():
    pcm = tone()
    parts, _ = streamed("wav", pcm)
    data = b"".join(parts)
    assert data.startswith(b"RIFF\xff\xff\xff\xffWAVE") and data[40:44] == b"\xff\xff\xff\xff"  # length unknown
    assert len(parts[0]) == 44 + 2 * 5000  # the header rides with the first samples, not on its own
    back, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == RATE and np.array_equal(back, pcm)
    assert av_probe(data)[2] == pytest.approx(SECONDS, abs=1e-3)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac"])
def test_streamed_compressed_formats_produce_bytes_as_they_go_and_play(fmt):
    parts, enc = streamed(fmt, tone())
    assert sum(1 for p in parts[:-1] if p) >= len(parts) // 2  # not everything held back until finish()
    _, rate, seconds = av_probe(b"".join(parts))
    assert rate == enc.rate
    assert SECONDS - 0.05 <= seconds <= SECONDS + 0.15


@pytest.mark.parametrize("fmt", audio.FORMATS)
def test_a_whole_file_encoder_holds_everything_until_finish(fmt):
    enc = audio.encoder(fmt, RATE, streamed=False)
    assert [enc.write(p) for p in np.array_split(tone(), 4)] == [b""] * 4
    data = enc.finish()
    assert len(data) > 1000
    if fmt != "pcm":
        assert av_probe(data)[2] == pytest.approx(SECONDS, abs=0.15)


@pytest.mark.parametrize("fmt", audio.FORMATS)
def test_an_encoder_finished_before_any_samples_still_closes_cleanly(fmt):
    # a request cancelled before its first sentence finishes its encoder with nothing written
    for streamed_ in (True, False):
        assert isinstance(audio.encoder(fmt, RATE, streamed=streamed_).finish(), bytes)


def test_streamed_pcm_matches_whole_pcm_length():
    pcm = tone()
    parts, _ = streamed("pcm", pcm)
    data = b"".join(parts)
    assert len(data) % 2 == 0
    assert abs(len(data) - len(audio.encode(pcm, RATE, "pcm"))) <= 4


def test_wav_header_with_a_known_length_is_what_the_wave_module_reads():
    header = audio.wav_header(16000, 3200)
    with wave.open(io.BytesIO(header + b"\0" * 3200)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (16000, 1, 2, 1600)
    assert struct.unpack("<I", header[4:8])[0] == 36 + 3200


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown audio format"):
        audio.encoder("ogg-vorbis", RATE)


def test_decode_resamples_and_mixes_stereo_to_mono_float32():
    left = tone(1.0, 44100, 440.0)
    buf = io.BytesIO()
    sf.write(buf, np.stack([left, left], axis=1), 44100, format="WAV", subtype="PCM_16")
    x = audio.decode(buf.getvalue(), 16000)
    assert x.dtype == np.float32 and x.ndim == 1
    assert abs(len(x) - 16000) <= 32
    assert 0.3 < np.abs(x).max() <= 1.0  # scaled to [-1, 1], not int16 range
    assert abs(np.argmax(np.abs(np.fft.rfft(x))) * 16000 / len(x) - 440) < 2


@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac"])
def test_decode_reads_what_encode_writes(fmt):
    x = audio.decode(audio.encode(tone(), RATE, fmt), 16000)
    assert abs(len(x) / 16000 - SECONDS) < 0.15


@pytest.mark.parametrize("data", [b"", b"this is not audio at all " * 40, bytes(range(256)) * 64])
def test_decode_refuses_what_is_not_audio(data):
    with pytest.raises(audio.AudioDecodeError) as err:
        audio.decode(data, 16000)
    assert "errno" not in str(err.value).lower()  # a message for an API user, not FFmpeg's internals


def test_decode_refuses_audio_longer_than_the_limit():
    wav = audio.encode(tone(3.0), RATE, "wav")
    with pytest.raises(audio.AudioDecodeError, match="longer than the 1 s"):
        audio.decode(wav, 16000, max_s=1.0)
    assert len(audio.decode(wav, 16000, max_s=5.0)) > 0
