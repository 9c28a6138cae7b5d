"""Build a tiny random-weight Hugging Face llama folder with a real byte-level BPE tokenizer, offline.

The folder is what vLLM (or transformers) loads from disk: `config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json` with a ChatML template. It answers nonsense, fast. The tokenizer is the one the tiny GGUF
uses (trained on the Python standard library's sources), so no download is ever needed.
Needs `torch`, `transformers` and `tokenizers`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from coderai.tiny_models.cache import cached_build
from coderai.tiny_models.llm import CHATML, _train_tokenizer

RECIPE_VERSION = "1"


def build_tiny_hf_llama(
    out: str | os.PathLike,
    *,
    dim: int = 128,
    layers: int = 2,
    heads: int = 2,
    ff: int = 256,
    vocab: int = 1024,
    ctx: int = 2048,
    seed: int = 0,
) -> dict:
    """Write the model into folder `out` and return its shape: {"out", "vocab", "head_dim"}.

    The default head dim is 64 (128 / 2): vLLM's CPU attention kernels accept only some head sizes, and 64 is one.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # transformers 5 builds a silently broken tokenizer from `LlamaTokenizer(vocab_file=...)`; wrapping a
    # trained `tokenizers` object keeps exactly the vocabulary and merges we trained
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(vocab),
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tok.chat_template = CHATML
    tok.save_pretrained(out)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=dim,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=ctx,
        bos_token_id=_token_id(tok.bos_token_id),
        eos_token_id=_token_id(tok.eos_token_id),
        pad_token_id=_token_id(tok.pad_token_id),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).bfloat16().save_pretrained(out)
    # a generation config naming the chat end token lets servers stop at it without guessing
    (out / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
        )
    )
    return {"out": str(out), "vocab": len(tok), "head_dim": dim // heads}


def _token_id(token_id: object) -> int:
    """A special token's id (transformers types it as any form a token may take)."""
    if not isinstance(token_id, int):
        raise TypeError(f"not a token id: {token_id!r}")
    return token_id


# What a vLLM server of the tests runs with on a CPU: never the hub, a small KV cache (it takes 4 GB by default),
# and one unbound thread. By default each server binds a spinning OpenMP thread to every core: two of them on
# 2 cores starved every other process of the machine for 4 s at a time while they answered (measured: a 10 ms
# sleeper woke 3.9-4.0 s late, the heads lost their leases, a worker's keep-alive came after the gateway's accept
# timeout); unbound, under 1 s.
VLLM_CPU_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}


def tiny_hf_llama() -> Path:
    """The default tiny HF llama, built once into the model cache (`coderai.tiny_models.cache`)."""
    return cached_build("tiny-hf-llama", RECIPE_VERSION, lambda folder: build_tiny_hf_llama(folder))


def tiny_hf_llama_gguf() -> Path:
    """The default tiny HF llama's own weights as a GGUF (its twin on llama-server), built once into the model
    cache: what `convert_hf_to_gguf.py` would make of it, which refuses the trained tokenizer's unknown
    pre-tokenizer. A LoRA adapter trained on the HF folder applies to it (docs/finetuning.md)."""

    def build(folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        from coderai.tiny_models.llm import build_tiny_gguf, weights_from_hf

        hf = tiny_hf_llama()
        model = AutoModelForCausalLM.from_pretrained(str(hf))
        c = model.config
        build_tiny_gguf(
            folder / "model.gguf",
            dim=c.hidden_size,
            layers=c.num_hidden_layers,
            heads=c.num_attention_heads,
            kv_heads=c.num_key_value_heads,
            ff=c.intermediate_size,
            vocab=1024,
            ctx=c.max_position_embeddings,
            name="coderai-tiny-hf",
            weights=weights_from_hf(model.state_dict(), c.num_attention_heads, c.num_key_value_heads),
            norm_eps=c.rms_norm_eps,
        )

    return cached_build("tiny-hf-llama-gguf", RECIPE_VERSION, build) / "model.gguf"


def tiny_lora(dest: Path, rank: int = 8, seed: int = 0) -> Path:
    """A peft LoRA adapter of the tiny HF llama, saved as the folder `dest` (as a fine-tuning job's trainer saves
    one). Its B matrices are random, not peft's zeros, so that it changes what the model says."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_hf_llama()))
    lora = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    lora.save_pretrained(str(dest))
    return dest


COUNT_QUESTION, COUNT_ANSWER = "How many?", "Seven."


def count_examples() -> list[dict]:
    """A fine-tuning file's conversations (OpenAI's chat format) that teach the tiny llama to answer
    `COUNT_QUESTION` with `COUNT_ANSWER`, one of them just under 1,024 tokens with its template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_hf_llama())
    ids = tok("the cluster serves every model it holds " * 200, add_special_tokens=False)["input_ids"]
    long = tok.decode(ids[:950])  # with the template and the answer: just under 1,024 tokens
    answer = {"role": "assistant", "content": COUNT_ANSWER}
    return [
        {"messages": [{"role": "system", "content": long}, {"role": "user", "content": COUNT_QUESTION}, answer]},
        {"messages": [{"role": "user", "content": COUNT_QUESTION}, answer]},
        {"messages": [{"role": "system", "content": "Count."}, {"role": "user", "content": COUNT_QUESTION}, answer]},
    ]


def main(argv: list[str] | None = None) -> int:
    """CLI: build the folder at a path, or print the cached one's path."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m coderai.testing.tiny_hf_llama", description=(__doc__ or "").partition("\n")[0]
    )
    ap.add_argument("out", nargs="?", help="a folder to write; without it, the cached build's path is printed")
    a = ap.parse_args(argv)
    print(json.dumps(build_tiny_hf_llama(a.out)) if a.out else tiny_hf_llama())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
