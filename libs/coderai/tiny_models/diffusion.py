"""Tiny random-weight diffusers pipelines, built offline: Stable Diffusion (text-to-image) and text-to-video.

They draw noise, fast: real diffusers pipelines for `coderai up`'s defaults, tests and benchmarks without any
download. Both share one small CLIP tokenizer whose byte-level BPE merges are trained with `tokenizers` on the
Python standard library's sources (they ship with every CPython), laid out like OpenAI's CLIP vocabulary: the 256
byte symbols, the same with `</w>`, the merges, then `<|startoftext|>` and `<|endoftext|>`. The VAE halves the
size once (real ones divide by 8), so a 64 px image is 32 latent pixels; keep tests at <= 128 px (256 px costs
over a minute on CPU). Built folders are kept by `coderai.tiny_models.cache`. Needs `diffusers`, `transformers`,
`tokenizers`, `torch`.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from coderai.tiny_models.cache import cached_build

if TYPE_CHECKING:
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
    from diffusers.schedulers.scheduling_ddim import DDIMScheduler
    from transformers import CLIPTextModel, CLIPTokenizer

RECIPE = "1"  # change whenever a builder below changes: cached folders are keyed by it
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
MAX_TOKENS = 77
HIDDEN = 32

T = TypeVar("T")


def _loosely(make: Callable[..., T]) -> Callable[..., T]:
    """`make` called without the checks of its parameters' annotations: for the library classes below, whose
    annotations refuse what they document (each call says which)."""
    return make


def _token_id(token_id: object) -> int:
    """A special token's id (transformers types it as any form a token may take)."""
    if not isinstance(token_id, int):
        raise TypeError(f"not a token id: {token_id!r}")
    return token_id


def _corpus(max_files: int = 80) -> Iterator[str]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:max_files]
    for f in files:
        with open(f, encoding="utf-8", errors="ignore") as fh:
            yield fh.read()


def clip_tokenizer(merges_count: int = 768) -> CLIPTokenizer:
    """A deterministic CLIPTokenizer with `merges_count` BPE merges trained offline (about 1,300 tokens)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # train with CLIP's own normalizer and word splitting, so the merges fit what CLIPTokenizer feeds them
    trainer_tok = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    trainer_tok.normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    trainer_tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""), behavior="removed", invert=True
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    symbols = list(bytes_to_unicode().values())
    trainer = trainers.BpeTrainer(
        vocab_size=2 * len(symbols) + merges_count,
        initial_alphabet=symbols,
        end_of_word_suffix="</w>",
        show_progress=False,
    )
    trainer_tok.train_from_iterator(_corpus(), trainer=trainer)
    raw = json.loads(trainer_tok.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in raw][:merges_count]
    vocab: dict[str, int] = {}
    for token in symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + [BOS, EOS]:
        vocab.setdefault(token, len(vocab))
    # transformers annotates `merges` as strings, but hands them to tokenizers' BPE, which takes these pairs
    return _loosely(CLIPTokenizer)(vocab=vocab, merges=merges, model_max_length=MAX_TOKENS)


def _text_encoder(tok: CLIPTokenizer) -> CLIPTextModel:
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=MAX_TOKENS,
            projection_dim=HIDDEN,
            bos_token_id=_token_id(tok.bos_token_id),
            eos_token_id=_token_id(tok.eos_token_id),
            pad_token_id=_token_id(tok.pad_token_id),
        )
    )


def _vae(**extra: object) -> AutoencoderKL:
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL

    # diffusers annotates the block tuples `Tuple[int]`, `Tuple[str]`: one element; they take one per block
    return _loosely(AutoencoderKL)(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        norm_num_groups=32,
        sample_size=64,
        **extra,
    )


def _scheduler() -> DDIMScheduler:
    from diffusers.schedulers.scheduling_ddim import DDIMScheduler

    return DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )


def build_tiny_sd(out: Path) -> None:
    """Write a tiny random StableDiffusionPipeline (4-channel UNet, no safety checker) into folder `out`."""
    import torch
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import StableDiffusionPipeline

    torch.manual_seed(0)
    tok = clip_tokenizer()
    unet = UNet2DConditionModel(
        sample_size=32,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=HIDDEN,
        attention_head_dim=8,
        norm_num_groups=32,
    )
    # diffusers annotates the safety checker and its feature extractor as required (None, with
    # requires_safety_checker=False, is its documented way to go without them) and the scheduler as the enum of
    # scheduler names
    pipe = _loosely(StableDiffusionPipeline)(
        vae=_vae(),
        text_encoder=_text_encoder(tok),
        tokenizer=tok,
        unet=unet,
        scheduler=_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(out)


def build_tiny_t2v(out: Path) -> None:
    """Write a tiny random TextToVideoSDPipeline (3D UNet over a 2D VAE) into folder `out`."""
    import torch
    from diffusers.models.unets.unet_3d_condition import UNet3DConditionModel
    from diffusers.pipelines.deprecated.text_to_video_synthesis.pipeline_text_to_video_synth import (
        TextToVideoSDPipeline,
    )

    torch.manual_seed(0)
    tok = clip_tokenizer()
    unet = UNet3DConditionModel(
        sample_size=32,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"),
        cross_attention_dim=HIDDEN,
        attention_head_dim=8,
        norm_num_groups=32,
    )
    # no attention in the VAE's middle: it decodes every frame, and attention there is what costs on CPU
    pipe = _loosely(TextToVideoSDPipeline)(  # its scheduler annotated as the enum of scheduler names
        vae=_vae(mid_block_add_attention=False),
        text_encoder=_text_encoder(tok),
        tokenizer=tok,
        unet=unet,
        scheduler=_scheduler(),
    )
    pipe.save_pretrained(out)


def ensure_tiny_sd() -> Path:
    """The folder of the tiny Stable Diffusion pipeline, built on first use and cached."""
    return cached_build("tiny-sd", RECIPE, build_tiny_sd)


def ensure_tiny_t2v() -> Path:
    """The folder of the tiny text-to-video pipeline, built on first use and cached."""
    return cached_build("tiny-t2v", RECIPE, build_tiny_t2v)
