"""Whisper checkpoints as whisper.cpp's ggml model file, converted offline with numpy alone (no torch), and the
checks that a ggml file is one whisper.cpp loads (`inspect_ggml`, which the `whispercpp` engine runs first).

No ggml Whisper ships on PyPI, so the `whispercpp` family's models are made here from a Hugging Face or a
CTranslate2 Whisper folder (`whisper_checkpoints` reads both): `convert(folder, file)`.

The ggml file (whisper.cpp's `whisper_model_load` reads it in this order, all little-endian):
1. magic `ggml` (0x67676d6c), then 11 int32 hparams: n_vocab, n_audio_ctx, n_audio_state, n_audio_head,
   n_audio_layer, n_text_ctx, n_text_state, n_text_head, n_text_layer, n_mels, ftype (0 f32, 1 f16; written: 1);
2. the mel filterbank: int32 n_mel, int32 n_fft (201), then n_mel x n_fft float32;
3. the vocabulary: int32 count, then per token int32 length and its raw bytes. Only the ordinary tokens (those
   before `<|endoftext|>`) are written: whisper.cpp places the special, language and timestamp tokens itself from
   n_vocab, and a prompt holding `<|en|>` must stay text;
4. tensors until the end: int32 n_dims, int32 name length, int32 type (0 f32, 1 f16), n_dims int32 sizes
   innermost first (ggml's order, the reverse of numpy's), the name, the data. whisper.cpp wants every tensor it
   knows (a missing or unknown one fails the load), 1-D ones, conv biases and position embeddings as f32 and, in
   an f16 file, the matrices (conv weights included) as f16.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from coderai.tiny_models.cache import cached_build
from coderai.tiny_models.whisper_checkpoints import Checkpoint, ConversionError, read_ct2, read_hf

GGML_MAGIC = 0x67676D6C
SAMPLE_RATE = 16000
N_FFT = 400
RECIPE_VERSION = "1"  # bump whenever the conversion changes: cached builds are keyed by it
_ALWAYS_F32 = {
    "encoder.conv1.bias",
    "encoder.conv2.bias",
    "encoder.positional_embedding",
    "decoder.positional_embedding",
}


def convert(src: str | Path, dst: str | Path) -> Path:
    """Write the Whisper checkpoint in folder `src` (Hugging Face or CTranslate2) as whisper.cpp's ggml file `dst`,
    its matrices as float16. Returns `dst`."""
    folder = Path(src)
    if (folder / "model.bin").is_file():
        ckpt = read_ct2(folder)
    elif (folder / "config.json").is_file():
        ckpt = read_hf(folder)
    else:
        raise ConversionError(f"{folder} is neither a CTranslate2 folder (model.bin) nor a Hugging Face one")
    out = Path(dst)
    tmp = out.with_name(out.name + ".part")
    with open(tmp, "wb") as fh:
        write_ggml(ckpt, fh)
    tmp.replace(out)
    return out


def ensure_tiny_whisper_ggml(text: str | None = None) -> Path:
    """The ggml file of the project's tiny Whisper (`coderai.tiny_models.whisper`, overfitted on `text`), converted
    once and cached beside it."""
    from coderai.tiny_models.whisper import TRAINING_TEXT, ensure_tiny_whisper

    phrase = TRAINING_TEXT if text is None else text
    digest = hashlib.sha256(phrase.encode()).hexdigest()[:12]
    folder = cached_build(
        f"tiny-whisper-ggml-{digest}",
        RECIPE_VERSION,
        lambda out: convert(ensure_tiny_whisper(phrase), out / "ggml-model.bin"),
    )
    return folder / "ggml-model.bin"


# ---- the ggml file


def write_ggml(ckpt: Checkpoint, fh: BinaryIO) -> None:
    """`ckpt` in whisper.cpp's file format (the module docstring) to the open binary file `fh`, as ftype 1 (f16):
    whisper.cpp's convolution asks ggml for an f16 im2col, which aborts the process on f32 conv weights, and an
    ftype 0 (f32) file gets f32 conv weights."""
    t = ckpt.tensors
    for name in _required_names(_layers(t, "encoder"), _layers(t, "decoder")):
        if name not in t:
            raise ConversionError(f"the checkpoint has no {name} (whisper.cpp needs every tensor)")
    n_vocab, n_state = t["decoder.token_embedding.weight"].shape
    n_mels = t["encoder.conv1.weight"].shape[1]
    hparams = (
        n_vocab,
        t["encoder.positional_embedding"].shape[0],
        n_state,
        ckpt.n_audio_head,
        _layers(t, "encoder"),
        t["decoder.positional_embedding"].shape[0],
        n_state,
        ckpt.n_text_head,
        _layers(t, "decoder"),
        n_mels,
        1,
    )
    fh.write(struct.pack("<I11i", GGML_MAGIC, *hparams))
    filters = mel_filters(n_mels)
    fh.write(struct.pack("<2i", *filters.shape))
    fh.write(filters.astype("<f4").tobytes())
    fh.write(struct.pack("<i", len(ckpt.tokens)))
    for token in ckpt.tokens:
        fh.write(struct.pack("<i", len(token)) + token)
    for name, data in sorted(t.items()):
        if name in ("encoder.conv1.bias", "encoder.conv2.bias"):
            data = data.reshape(-1, 1)  # whisper.cpp adds them to a [n_state, 1] column
        half = data.ndim >= 2 and name not in _ALWAYS_F32
        arr = np.ascontiguousarray(data, dtype="<f2" if half else "<f4")
        raw = name.encode()
        fh.write(struct.pack("<3i", arr.ndim, len(raw), 1 if half else 0))
        fh.write(struct.pack(f"<{arr.ndim}i", *reversed(arr.shape)))
        fh.write(raw)
        fh.write(arr.tobytes())


def _layers(tensors: dict[str, np.ndarray], side: str) -> int:
    found = {int(m.group(1)) for n in tensors if (m := re.match(rf"{side}\.blocks\.(\d+)\.", n))}
    if found != set(range(len(found))):
        raise ConversionError(f"the {side} layers are not numbered 0..n-1: {sorted(found)}")
    return len(found)


def _required_names(n_audio_layer: int, n_text_layer: int) -> Iterator[str]:
    yield from ("encoder.positional_embedding", "encoder.ln_post.weight", "encoder.ln_post.bias")
    yield from ("encoder.conv1.weight", "encoder.conv1.bias", "encoder.conv2.weight", "encoder.conv2.bias")
    yield from (
        "decoder.positional_embedding",
        "decoder.token_embedding.weight",
        "decoder.ln.weight",
        "decoder.ln.bias",
    )
    block = ("mlp_ln", "mlp.0", "mlp.2", "attn_ln", "attn.query", "attn.value", "attn.out")
    for side, n, parts in (
        ("encoder", n_audio_layer, block),
        ("decoder", n_text_layer, (*block, "cross_attn_ln", "cross_attn.query", "cross_attn.value", "cross_attn.out")),
    ):
        for i in range(n):
            for part in parts:
                yield f"{side}.blocks.{i}.{part}.weight"
                yield f"{side}.blocks.{i}.{part}.bias"
            yield f"{side}.blocks.{i}.attn.key.weight"  # Whisper's key projections have no bias
            if side == "decoder":
                yield f"{side}.blocks.{i}.cross_attn.key.weight"


def mel_filters(n_mels: int, rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """The [n_mels, n_fft // 2 + 1] mel filterbank Whisper was trained with: librosa's `filters.mel` defaults
    (Slaney's mel scale and area normalisation, 0 Hz to Nyquist), which OpenAI's `mel_filters.npz` holds."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, np.log(6.4) / 27.0

    def to_mel(hz: np.ndarray) -> np.ndarray:
        return np.where(hz >= min_log_hz, min_log_mel + np.log(np.maximum(hz, 1e-10) / min_log_hz) / logstep, hz / f_sp)

    def to_hz(mel: np.ndarray) -> np.ndarray:
        return np.where(mel >= min_log_mel, min_log_hz * np.exp(logstep * (mel - min_log_mel)), f_sp * mel)

    fft_hz = np.linspace(0, rate / 2, n_fft // 2 + 1)
    edges = to_hz(np.linspace(to_mel(np.array(0.0)), to_mel(np.array(rate / 2)), n_mels + 2))
    ramps = edges[:, None] - fft_hz[None, :]
    widths = np.diff(edges)
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights.astype(np.float32)


# ---- reading a ggml file's layout back

# ggml tensor type -> (elements per block, bytes per block), for the types a whisper.cpp file may hold
_GGML_TYPES = {
    0: (1, 4),  # f32
    1: (1, 2),  # f16
    2: (32, 18),  # q4_0
    3: (32, 20),  # q4_1
    6: (32, 22),  # q5_0
    7: (32, 24),  # q5_1
    8: (32, 34),  # q8_0
    10: (256, 84),  # q2_K
    11: (256, 110),  # q3_K
    12: (256, 144),  # q4_K
    13: (256, 176),  # q5_K
    14: (256, 210),  # q6_K
}
# the file's ftype -> the type of its matrices (ggml_ftype_to_ggml_type); 0 (all f32) is left out: see write_ggml
_FTYPE_WTYPE = {1: 1, 2: 2, 3: 3, 7: 8, 8: 6, 9: 7, 10: 10, 11: 11, 12: 12, 13: 13, 14: 14}
_HPARAMS = (
    "n_vocab",
    "n_audio_ctx",
    "n_audio_state",
    "n_audio_head",
    "n_audio_layer",
    "n_text_ctx",
    "n_text_state",
    "n_text_head",
    "n_text_layer",
    "n_mels",
    "ftype",
)


@dataclass(frozen=True)
class GgmlInfo:
    """The hparams of a whisper.cpp model file, and what whisper.cpp derives from them."""

    n_vocab: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int
    n_mels: int
    ftype: int

    @property
    def multilingual(self) -> bool:
        return self.n_vocab >= 51865

    @property
    def n_languages(self) -> int:
        """How many language tokens it has: whisper.cpp's first n languages (99, or 100 for large-v3)."""
        return self.n_vocab - 51765 - int(self.multilingual) if self.multilingual else 1

    @property
    def timestamps(self) -> bool:
        """False for a model whisper.cpp takes for a first-release distilled one (2 decoder layers): it decodes
        those without timestamp tokens, one segment per 30-s window."""
        return not (self.n_text_layer == 2 and self.n_vocab != 51866)


def inspect_ggml(path: str | Path) -> GgmlInfo:
    """The hparams of the whisper.cpp model file `path`, after checking everything whisper.cpp's loader checks
    (magic, ftype, filters, vocabulary, every tensor present once with its name, shape and byte size) and that
    the file holds all it announces. ConversionError says what is wrong: whisper.cpp itself answers a bad file
    with a null context that crashes the process at first use, and an f32 one with an abort."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as fh:

        def ints(n: int, what: str) -> tuple[int, ...]:
            raw = fh.read(4 * n)
            if len(raw) != 4 * n:
                raise ConversionError(f"{p}: the file ends inside the {what}")
            return struct.unpack(f"<{n}i", raw)

        if ints(1, "magic")[0] != GGML_MAGIC:
            raise ConversionError(f"{p} is not a whisper.cpp ggml model (no ggml magic)")
        info = GgmlInfo(**dict(zip(_HPARAMS, ints(len(_HPARAMS), "hparams"))))
        ftype = info.ftype % 1000  # the quantization version rides in the thousands
        if ftype not in _FTYPE_WTYPE:
            why = "f32 files abort whisper.cpp's convolution" if ftype == 0 else "an unknown type"
            raise ConversionError(f"{p}: ftype {info.ftype} ({why}); use an f16 or quantized file")
        if min(getattr(info, h) for h in _HPARAMS[:-1]) <= 0 or info.n_audio_state != info.n_text_state:
            raise ConversionError(f"{p}: impossible hparams {info}")
        n_mel, n_fft = ints(2, "mel filters")
        if (n_mel, n_fft) != (info.n_mels, N_FFT // 2 + 1):
            raise ConversionError(f"{p}: mel filters {n_mel}x{n_fft}, expected {info.n_mels}x{N_FFT // 2 + 1}")
        fh.seek(4 * n_mel * n_fft, 1)
        (n_tokens,) = ints(1, "vocabulary")
        if not 0 <= n_tokens <= info.n_vocab:
            raise ConversionError(f"{p}: {n_tokens} tokens for a vocabulary of {info.n_vocab}")
        for _ in range(n_tokens):
            (length,) = ints(1, "vocabulary")
            if not 0 <= length <= 1024:
                raise ConversionError(f"{p}: a token of {length} bytes")
            fh.seek(length, 1)
        wanted = _expected_tensors(info, _FTYPE_WTYPE[ftype])
        seen: set[str] = set()
        while fh.tell() < size:
            n_dims, length, ttype = ints(3, "tensor headers")
            if not (1 <= n_dims <= 4 and 1 <= length <= 256 and ttype in _GGML_TYPES):
                raise ConversionError(f"{p}: a malformed tensor header at byte {fh.tell() - 12}")
            dims = ints(n_dims, "tensor headers")
            name = fh.read(length).decode(errors="replace")
            if name not in wanted or name in seen:
                raise ConversionError(f"{p}: unexpected tensor {name!r}")
            shape, wtype = wanted[name]
            block, nbytes = _GGML_TYPES[ttype]
            count = int(np.prod(dims))
            if dims + (1,) * (len(shape) - n_dims) != shape or count % block:
                raise ConversionError(f"{p}: tensor {name} is {list(dims)}, expected {list(shape)}")
            if count // block * nbytes != count // _GGML_TYPES[wtype][0] * _GGML_TYPES[wtype][1]:
                raise ConversionError(f"{p}: tensor {name} has type {ttype}, expected {wtype}")
            seen.add(name)
            fh.seek(count // block * nbytes, 1)
        if fh.tell() != size:
            raise ConversionError(f"{p}: the file ends inside tensor data")
    if missing := sorted(set(wanted) - seen):
        raise ConversionError(f"{p}: {len(missing)} tensors missing, such as {missing[0]}")
    return info


def _expected_tensors(info: GgmlInfo, wtype: int) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every tensor whisper.cpp creates for `info`: name -> (shape in ggml's order, 3 dims; its type)."""
    s, f32, f16 = info.n_audio_state, 0, 1
    out: dict[str, tuple[tuple[int, ...], int]] = {
        "encoder.positional_embedding": ((s, info.n_audio_ctx, 1), f32),
        "encoder.conv1.weight": ((3, info.n_mels, s), f16),
        "encoder.conv1.bias": ((1, s, 1), f32),
        "encoder.conv2.weight": ((3, s, s), f16),
        "encoder.conv2.bias": ((1, s, 1), f32),
        "decoder.positional_embedding": ((s, info.n_text_ctx, 1), f32),
        "decoder.token_embedding.weight": ((s, info.n_vocab, 1), wtype),
    }
    for name in _required_names(info.n_audio_layer, info.n_text_layer):
        if name not in out:
            vector = name.endswith(".bias") or name.split(".")[-2] in (
                "ln",
                "ln_post",
                "attn_ln",
                "mlp_ln",
                "cross_attn_ln",
            )
            if vector:
                out[name] = ((4 * s if ".mlp.0." in name else s, 1, 1), f32)
            elif ".mlp." in name:  # fc1 widens the state 4x, fc2 narrows it back
                out[name] = ((s, 4 * s, 1) if ".mlp.0." in name else (4 * s, s, 1), wtype)
            else:
                out[name] = ((s, s, 1), wtype)
    return out


__all__ = [
    "GgmlInfo",
    "convert",
    "ensure_tiny_whisper_ggml",
    "inspect_ggml",
    "mel_filters",
    "write_ggml",
]
