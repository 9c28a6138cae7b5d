"""A tiny Whisper that faster-whisper runs and that transcribes one phrase exactly, built offline.

The model is a random 2-layer Whisper whose decoder is overfitted on one phrase spoken by espeak-ng, then
converted to CTranslate2. Nothing is downloaded: the tokenizer is a byte-level BPE trained on the Python standard
library's sources, laid out like OpenAI's multilingual one (50,257 ordinary tokens, then the special, 99 language
and 1,501 timestamp tokens at the same ids), because CTranslate2 and faster-whisper find special tokens by text
and id and count languages from their positions. Building takes about half a minute on two cores and is cached
per phrase (`coderai.tiny_models.cache`).
Needs `faster-whisper` (ctranslate2), `transformers`, `torch`, `tokenizers` and Debian's `espeak-ng`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from coderai.tiny_models.cache import cached_build
from coderai.tiny_models.speech import RATE, speak_pcm

TRAINING_TEXT = "Hello world, this is a tiny speech test."
RECIPE_VERSION = "2"  # bump whenever the recipe changes: cached builds are keyed by it

# Whisper's language tokens, in its order (the 99 of the v1/v2 multilingual models)
LANGUAGES = (
    "en",
    "zh",
    "de",
    "es",
    "ru",
    "ko",
    "fr",
    "ja",
    "pt",
    "tr",
    "pl",
    "ca",
    "nl",
    "ar",
    "sv",
    "it",
    "id",
    "hi",
    "fi",
    "vi",
    "he",
    "uk",
    "el",
    "ms",
    "cs",
    "ro",
    "da",
    "hu",
    "ta",
    "no",
    "th",
    "ur",
    "hr",
    "bg",
    "lt",
    "la",
    "mi",
    "ml",
    "cy",
    "sk",
    "te",
    "fa",
    "lv",
    "bn",
    "sr",
    "az",
    "sl",
    "kn",
    "et",
    "mk",
    "br",
    "eu",
    "is",
    "hy",
    "ne",
    "mn",
    "bs",
    "kk",
    "sq",
    "sw",
    "gl",
    "mr",
    "pa",
    "si",
    "km",
    "sn",
    "yo",
    "so",
    "af",
    "oc",
    "ka",
    "be",
    "tg",
    "sd",
    "gu",
    "am",
    "yi",
    "lo",
    "uz",
    "fo",
    "ht",
    "ps",
    "tk",
    "nn",
    "mt",
    "sa",
    "lb",
    "my",
    "bo",
    "tl",
    "mg",
    "as",
    "tt",
    "haw",
    "ln",
    "ha",
    "ba",
    "jw",
    "su",
)
BASE_VOCAB = 50257  # ordinary tokens before <|endoftext|>, as in Whisper's multilingual tokenizer
TRAINED_VOCAB = 4096  # what BPE actually learns; the rest are unreachable fillers to reach BASE_VOCAB
TIME_STEP = 0.02
TIMESTAMPS = 1501
JUNK_FLOOR = -20.0  # log-probability of "end here" mid-sentence the overfit aims below


def ensure_tiny_whisper(text: str = TRAINING_TEXT) -> Path:
    """The CTranslate2 folder of a tiny Whisper that transcribes espeak-ng's reading of `text` as `text`.

    Built on first use (about half a minute on two cores) and cached by `text`; the folder holds
    `tokenizer.json` and `preprocessor_config.json`, so faster-whisper never reaches for the hub.
    """
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return cached_build(f"tiny-whisper-{digest}", RECIPE_VERSION, lambda out: build_tiny_whisper(out, text))


def build_tiny_whisper(out: Path, text: str, *, max_steps: int = 600, seed: int = 0) -> None:
    """Build, overfit on `text`, convert into the empty folder `out`, and check faster-whisper's transcript."""
    import torch

    pcm = speak_pcm(text).astype(np.float32) / 32768
    with torch.random.fork_rng(), tempfile.TemporaryDirectory(prefix="tiny-whisper-hf-") as hf_dir:
        torch.manual_seed(seed)
        tok = _whisper_tokenizer()
        model, fe = _random_model(tok)
        _overfit(model, tok, pcm, text, max_steps)
        model.save_pretrained(hf_dir)
        tok.save_pretrained(hf_dir)
        fe.save_pretrained(hf_dir)
        _convert(hf_dir, out)
    _check(out, pcm, text)


def _corpus(max_files: int = 300) -> list[str]:
    # English prose (docstrings, comments) and code, present wherever CPython is: no download
    texts = []
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:max_files]:
        with open(path, encoding="utf-8", errors="ignore") as fh:
            texts.append(fh.read())
    return texts


def _whisper_tokenizer() -> Any:
    """A transformers WhisperTokenizer on a freshly trained BPE, with Whisper's special tokens at Whisper's ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AddedToken, WhisperTokenizer  # tokenizers' AddedToken, as transformers annotates it

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TRAINED_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(_corpus(), trainer=trainer)
    learned = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = dict(learned["vocab"])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    # fillers no merge can produce: they only pad the id space so the special tokens land where Whisper's do
    for i in range(BASE_VOCAB - len(vocab) - 1):
        vocab[f"<unused{i}>"] = len(vocab)
    # CTranslate2 (4.8) calls a Whisper multilingual when its vocabulary holds the empty token, as OpenAI's
    # multilingual one does; without it faster-whisper drops the language and task tokens from every prompt
    vocab[""] = len(vocab)

    tok = WhisperTokenizer(vocab=vocab, merges=merges)
    specials = (
        ["<|endoftext|>", "<|startoftranscript|>"]
        + [f"<|{code}|>" for code in LANGUAGES]
        + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
    )
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    tok.add_tokens([AddedToken(f"<|{i * TIME_STEP:.2f}|>", special=False, normalized=False) for i in range(TIMESTAMPS)])
    if tok.convert_tokens_to_ids("<|endoftext|>") != BASE_VOCAB or len(tok) != BASE_VOCAB + len(specials) + TIMESTAMPS:
        raise RuntimeError("tiny whisper tokenizer: special tokens did not land at Whisper's ids")
    return tok


def _random_model(tok: Any, d_model: int = 64, layers: int = 2, heads: int = 4) -> tuple[Any, Any]:
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    ids = tok.convert_tokens_to_ids
    eot, sot = ids("<|endoftext|>"), ids("<|startoftranscript|>")
    suppress_begin = [ids("Ġ"), eot]  # Whisper's own rule: never start with a bare space or end at once
    cfg = WhisperConfig(
        vocab_size=len(tok),
        num_mel_bins=80,
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=4 * d_model,
        decoder_ffn_dim=4 * d_model,
        max_source_positions=1500,
        max_target_positions=448,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        begin_suppress_tokens=suppress_begin,
        suppress_tokens=[],
    )
    model = WhisperForConditionalGeneration(cfg)
    # CTranslate2 reads language ids and alignment heads (for word timestamps) from the generation config
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot,
        eos_token_id=eot,
        pad_token_id=eot,
        bos_token_id=eot,
        max_length=448,
        begin_suppress_tokens=suppress_begin,
        suppress_tokens=[],
        is_multilingual=True,
        no_timestamps_token_id=ids("<|notimestamps|>"),
        lang_to_id={f"<|{code}|>": ids(f"<|{code}|>") for code in LANGUAGES},
        task_to_id={"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")},
        alignment_heads=[[layers - 1, h] for h in range(heads)],
    )
    return model, WhisperFeatureExtractor(feature_size=80)


def _overfit(model: Any, tok: Any, pcm: np.ndarray, text: str, max_steps: int, target_loss: float = 0.005) -> None:
    """Teach the decoder one transcript, in faster-whisper's default timestamped form and in the
    `without_timestamps` form, for both tasks, language token included so that language detection answers `en`.

    The random encoder stays frozen: its output for this audio is computed once, which makes a step ~20x
    cheaper, and a decoder that memorises one sentence needs nothing better from it.
    """
    import torch
    from faster_whisper.audio import pad_or_trim
    from faster_whisper.feature_extractor import FeatureExtractor

    ids = tok.convert_tokens_to_ids
    sot, eot, no_timestamps = ids("<|startoftranscript|>"), ids("<|endoftext|>"), ids("<|notimestamps|>")
    words = tok.encode(" " + text.strip(), add_special_tokens=False)
    end = min(TIMESTAMPS - 1, int(len(pcm) / RATE / TIME_STEP))  # floored: the segment never outlasts the audio
    said = [ids("<|0.00|>")] + words + [ids(f"<|{end * TIME_STEP:.2f}|>")]
    rows = []
    for task in ("<|transcribe|>", "<|translate|>"):  # English speech translated to English is the same text
        head = [sot, ids("<|en|>"), ids(task)]
        rows += [head + said + [eot], head + [no_timestamps] + words + [eot]]

    def row_targets(row: list[int]) -> list[int]:
        out = row[1:]
        out[1] = -100  # the task token is the caller's choice, not something to predict
        return [-100 if t == no_timestamps else t for t in out]  # so is <|notimestamps|>

    width = max(map(len, rows))
    decoder_input = torch.tensor([r[:-1] + [eot] * (width - len(r)) for r in rows])
    labels = torch.tensor([row_targets(r) + [-100] * (width - len(r)) for r in rows])

    # the exact features faster-whisper computes: its own log-mel, padded with zeros to 30 s in feature space
    # (Hugging Face's extractor pads the audio instead, and a decoder trained on that misreads at inference)
    mel = FeatureExtractor(feature_size=model.config.num_mel_bins)(pcm)
    features = torch.from_numpy(pad_or_trim(mel[:, : mel.shape[-1] - 1]))[None]
    encoder = model.get_encoder()
    encoder.requires_grad_(False)
    with torch.no_grad():
        encoded = encoder(features).last_hidden_state.expand(len(rows), -1, -1)

    # Mid-sentence, a timestamp or the end token must be far less likely than any other wrong token. Beam search
    # fills its spare beams with runners-up; a runner-up timestamp is followed by a forced end (text may not follow
    # a lone timestamp), so each one becomes a finished junk hypothesis, and after `beam_size` of those the search
    # stops before the true sentence is done. Pushing their mass below JUNK_FLOOR keeps runners-up to text.
    stop_ids = torch.tensor([eot] + list(range(ids("<|0.00|>"), len(tok))))
    mid_sentence = (labels >= 0) & (labels < eot)
    targets = labels.clamp(min=0)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ops are tiny: more threads only add waiting on a busy machine
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    try:
        for _ in range(max_steps):
            # noise on the encoder output, so int8 weights and small numeric differences at inference do not matter
            noisy = encoded + 0.05 * torch.randn_like(encoded)
            logp = model(encoder_outputs=(noisy,), decoder_input_ids=decoder_input).logits.log_softmax(-1)
            nll = -logp.gather(-1, targets[..., None])[..., 0][labels >= 0].mean()
            junk = (logp[..., stop_ids].logsumexp(-1)[mid_sentence] - JUNK_FLOOR).clamp(min=0).mean()
            loss = nll + junk
            opt.zero_grad()
            loss.backward()
            opt.step()
            if nll.item() < target_loss and junk.item() == 0:
                break
    finally:
        torch.set_num_threads(threads)
        encoder.requires_grad_(True)
    model.eval()


def _convert(hf_dir: str, out: Path) -> None:
    from ctranslate2.converters import TransformersConverter

    converter = TransformersConverter(hf_dir, copy_files=["tokenizer.json", "preprocessor_config.json"])
    converter.convert(str(out), quantization="float32", force=True)  # the engine quantizes at load


def _check(out: Path, pcm: np.ndarray, text: str) -> None:
    """Refuse to cache a model that faster-whisper does not read back exactly."""
    from faster_whisper import WhisperModel

    model = WhisperModel(str(out), device="cpu", compute_type="int8", cpu_threads=2)
    want = " ".join(text.split())
    for options in ({}, {"language": "en", "without_timestamps": True}):
        segments, info = model.transcribe(pcm, temperature=0.0, **options)
        got = " ".join("".join(s.text for s in segments).split())
        if got != want or info.language != "en":
            raise RuntimeError(
                f"tiny whisper did not learn its phrase: got {got!r} (language {info.language!r}, options {options})"
            )
