"""Build a tiny random-weight llama-architecture GGUF with a real byte-level BPE tokenizer, offline.

It answers nonsense, fast: a real llama.cpp model for tests, benchmarks and the first `coderai up`, without
any download. The tokenizer is trained on the Python standard library's sources, which ship with every CPython.
Needs `gguf`, `tokenizers` and `numpy` (the `llama` extra).
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus(max_files: int = 200) -> Iterator[str]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:max_files]
    for f in files:
        with open(f, encoding="utf-8", errors="ignore") as fh:
            yield fh.read()


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def build_tiny_gguf(
    out: str | os.PathLike,
    *,
    dim: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 0,
    ff: int = 0,
    vocab: int = 1024,
    ctx: int = 2048,
    f32: bool = False,
    seed: int = 0,
    name: str = "coderai-tiny",
    chat_template: str = CHATML,
    weights: dict | None = None,
    norm_eps: float = 1e-5,
) -> dict:
    """Write the model to `out` (atomically) and return its shape: {"out", "vocab", "params", "bytes"}.

    `weights` (GGUF tensor name -> numpy array, as `weights_from_hf` gives) replaces the random ones: a model
    trained in torch on this same tokenizer (see tool_gguf)."""
    import gguf
    import numpy as np

    kv = kv_heads or heads
    ff = ff or 4 * dim
    head_dim = dim // heads
    tok = _train_tokenizer(vocab)
    data = json.loads(tok.to_str())
    vocab_map: dict[str, int] = data["model"]["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    n_vocab = len(vocab_map)
    tokens = [""] * n_vocab
    for t, i in vocab_map.items():
        tokens[i] = t
    ttypes = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens]

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".part")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(name)
    w.add_context_length(ctx)
    w.add_embedding_length(dim)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(norm_eps)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if f32 else gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab_map["<|endoftext|>"])
    w.add_eos_token_id(vocab_map["<|im_end|>"])
    w.add_pad_token_id(vocab_map["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template)

    rng = np.random.default_rng(seed)
    wt = np.float32 if f32 else np.float16

    def mat(rows: int, cols: int):  # numpy (rows, cols) is ggml ne [cols, rows]
        if weights is not None:
            return weights[names.pop(0)].astype(wt)
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(wt)

    def ones(n: int):
        if weights is not None:
            return weights[names.pop(0)].astype(np.float32)
        return np.ones(n, dtype=np.float32)

    names = tensor_names(layers)  # the order the tensors are written in below

    w.add_tensor("token_embd.weight", mat(n_vocab, dim))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones(dim))
        w.add_tensor(p + "attn_q.weight", mat(heads * head_dim, dim))
        w.add_tensor(p + "attn_k.weight", mat(kv * head_dim, dim))
        w.add_tensor(p + "attn_v.weight", mat(kv * head_dim, dim))
        w.add_tensor(p + "attn_output.weight", mat(dim, heads * head_dim))
        w.add_tensor(p + "ffn_norm.weight", ones(dim))
        w.add_tensor(p + "ffn_gate.weight", mat(ff, dim))
        w.add_tensor(p + "ffn_up.weight", mat(ff, dim))
        w.add_tensor(p + "ffn_down.weight", mat(dim, ff))
    w.add_tensor("output_norm.weight", ones(dim))
    w.add_tensor("output.weight", mat(n_vocab, dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    params = n_vocab * dim * 2 + layers * (dim * (heads + 2 * kv) * head_dim + dim * dim + 3 * dim * ff)
    return {"out": str(out), "vocab": n_vocab, "params": params, "bytes": out.stat().st_size}


def tensor_names(layers: int) -> list[str]:
    """The GGUF tensor names of a llama of `layers` blocks, in the order build_tiny_gguf writes them."""
    block = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    return (
        ["token_embd.weight"]
        + [f"blk.{i}.{t}.weight" for i in range(layers) for t in block]
        + ["output_norm.weight", "output.weight"]
    )


def weights_from_hf(state: dict, heads: int, kv_heads: int) -> dict:
    """GGUF tensors (numpy, float32) from a transformers LlamaForCausalLM state dict. Q and K rows are permuted
    from Hugging Face's rotate-half RoPE layout to llama.cpp's interleaved one, as llama.cpp's converter does."""

    def permute(w, n_head: int):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    def get(key: str):
        return state[key].detach().float().cpu().numpy()

    out = {
        "token_embd.weight": get("model.embed_tokens.weight"),
        "output_norm.weight": get("model.norm.weight"),
        "output.weight": get("lm_head.weight"),
    }
    hf = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    i = 0
    while f"model.layers.{i}.input_layernorm.weight" in state:
        for ours, theirs in hf.items():
            w = get(f"model.layers.{i}.{theirs}.weight")
            if ours == "attn_q":
                w = permute(w, heads)
            elif ours == "attn_k":
                w = permute(w, kv_heads)
            out[f"blk.{i}.{ours}.weight"] = w
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m coderai.tiny_models.llm", description=(__doc__ or "").partition("\n")[0]
    )
    ap.add_argument("out")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--ctx", type=int, default=2048)
    a = ap.parse_args(argv)
    print(json.dumps(build_tiny_gguf(a.out, dim=a.dim, layers=a.layers, heads=a.heads, vocab=a.vocab, ctx=a.ctx)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
