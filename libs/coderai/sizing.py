"""The memory rules every service agrees on: what one loaded copy of a model needs, and what a node offers.

A copy needs `memory_mb` if the config says so. A GGUF (the llama families) the scheduler can read needs its
tensor data, plus the KV cache its context and slots take, plus a compute overhead (see `Estimate`); any other
model its file size x 1.2 plus 256 MB (an estimate that errs large); a folder model counts every file in it.

A node offers pools (`pools`): each GPU its own (90 % of its memory), and its RAM (the worker's memory budget,
else 90 %). A copy runs either on the CPU, against the RAM pool alone, or on one GPU, or (a llama.cpp model that
fits no single card) on several cards of one node together. The scheduler places by these, the catalogue says
where a model fits.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from coderai.contracts import GGUF_FAMILIES, Heartbeat, ModelConfig
from coderai.contracts.families import CPU_FAMILIES, CPU_UNLESS_ASKED

MB = 1 << 20
OVERHEAD = 256 * MB
USABLE = 0.9
UNKNOWN_CAPACITY = 1 << 62

# what the llama engines run with when the params do not say (engines/llama_server_args.py, engines/llama.py; a test
# holds them equal): llama-server's context is n_ctx per slot times its slots, in-process llama one sequence
SERVER_PARALLEL = 4
DEFAULT_N_CTX = 2048
DEFAULT_UBATCH = 512
# bytes per cached K or V element by llama.cpp's cache type (quantized types: block bytes / 32 elements);
# llama-server's `cache_type_k` names them, llama-cpp-python's `type_k` takes ggml's enum
CACHE_TYPE_BYTES = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
    "q5_0": 22 / 32,
    "q5_1": 24 / 32,
    "iq4_nl": 18 / 32,
}
GGML_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 20: "iq4_nl", 30: "bf16"}
# engine families that never use a GPU (onnxruntime on the CPU, or nothing at all), and those that do only when
# their `device` param names one (sentence-transformers, faster-whisper and resemblyzer default to the CPU): each
# family's `FamilySpec.device`


@dataclass(frozen=True)
class Estimate:
    """One copy's memory split by what takes it: `source` says where the figure came from ("memory_mb" set by
    hand, "gguf" from the file's metadata, "file size" by the rule of thumb)."""

    weights: int
    kv_cache: int
    overhead: int
    source: str

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.overhead


def path_bytes(path: str) -> int:
    """Bytes of a model file, or of every file in a model folder; 0 when it is not on this machine."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        total = 0
        for root, _dirs, files in os.walk(path):
            for f in files:
                try:
                    total += os.path.getsize(os.path.join(root, f))
                except OSError:
                    pass
        return total
    try:
        return os.path.getsize(path)
    except OSError:
        return 0  # the file lives on the nodes only: count the overhead alone


@functools.lru_cache(maxsize=256)
def _layout(path: str, _size: int, _mtime: float):
    """A GGUF's header layout, read once per file version (the scheduler re-plans every few seconds)."""
    from coderai.runtime.gguf_meta import layout

    return layout(path)


def _cache_bytes(p: dict[str, object], name: str) -> float:
    ggml = p.get(f"type_{name}")  # llama-cpp-python's `type_k`: a ggml type number
    kind = p.get(f"cache_type_{name}") or (GGML_TYPES.get(ggml, "f16") if isinstance(ggml, int) else "f16")
    return CACHE_TYPE_BYTES.get(str(kind).lower(), 2.0)


def gguf_estimate(m: ModelConfig, path: str) -> Estimate | None:
    """Weights + KV cache + compute overhead from a GGUF's header; None when the file is not a GGUF here.

    KV: K and V per layer, n_ctx x n_head_kv x head_dim elements each (f16 unless the params pick a cache type),
    n_ctx being llama-server's whole --ctx-size (n_ctx per slot x parallel). Overhead: the runtime (256 MB) and
    llama.cpp's compute buffer, which the logits of one micro-batch dominate (n_vocab x n_ubatch floats). Sliding
    window layers are counted at full context: it errs large, as the rule for other files does."""
    try:
        st = os.stat(path)
        lay = _layout(path, st.st_size, st.st_mtime)
    except (OSError, ValueError):
        return None
    meta, p = lay.meta, m.params
    arch = meta.get("general.architecture", "")
    n_layer = int(meta.get(f"{arch}.block_count") or 0)
    heads = meta.get(f"{arch}.attention.head_count") or 0
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    per_layer = kv_heads if isinstance(kv_heads, list) else [int(kv_heads)] * n_layer
    n_head = max(heads) if isinstance(heads, list) else int(heads)
    k_len = int(
        meta.get(f"{arch}.attention.key_length") or (int(meta.get(f"{arch}.embedding_length") or 0) // max(1, n_head))
    )
    v_len = int(meta.get(f"{arch}.attention.value_length") or k_len)
    if m.engine == "llama-server":
        n_ctx = (m.param_int("n_ctx") or DEFAULT_N_CTX) * (m.param_int("parallel") or SERVER_PARALLEL)
    else:  # n_ctx 0: the model's own context length
        n_ctx = m.param_int("n_ctx", DEFAULT_N_CTX) or int(meta.get(f"{arch}.context_length") or DEFAULT_N_CTX)
    elements = n_ctx * sum(int(h) for h in per_layer)
    kv = int(elements * k_len * _cache_bytes(p, "k") + elements * v_len * _cache_bytes(p, "v"))
    ubatch = min(m.param_int("n_ubatch") or DEFAULT_UBATCH, m.param_int("n_batch") or DEFAULT_UBATCH, n_ctx)
    logits = lay.lengths.get("tokenizer.ggml.tokens", 0) * ubatch * 4
    return Estimate(
        weights=max(0, st.st_size - lay.data_offset), kv_cache=kv, overhead=OVERHEAD + logits, source="gguf"
    )


def estimate(m: ModelConfig, file_size: int | None = None) -> Estimate:
    """What one copy of `m` needs, split into weights, KV cache and overhead. `file_size` (the store's record of
    a file the scheduler may not have) is used as given for the file-size rule."""
    if m.memory_mb:
        return Estimate(weights=m.memory_mb * MB, kv_cache=0, overhead=0, source="memory_mb")
    path = os.path.expanduser(m.path)
    if m.engine in GGUF_FAMILIES and file_size is None and os.path.isfile(path):
        if (got := gguf_estimate(m, path)) is not None:
            return got
    if file_size is None:
        file_size = path_bytes(m.path)
    return Estimate(
        weights=file_size, kv_cache=0, overhead=int(file_size * 1.2) - file_size + OVERHEAD, source="file size"
    )


def estimate_bytes(m: ModelConfig, file_size: int | None = None) -> int:
    """`estimate(m, file_size).total`."""
    return estimate(m, file_size).total


def runs_on_cpu(m: ModelConfig) -> bool:
    """Whether a copy of `m` stays off the GPUs of a node that has them: its family never uses one, its params put
    it on the CPU (`device = "cpu"`, `n_gpu_layers = 0`), or its family defaults to the CPU unless `device` says."""
    device = str(m.params.get("device") or "").lower()
    if m.engine in CPU_FAMILIES or device.startswith("cpu"):
        return True
    if m.engine in GGUF_FAMILIES and m.param_int("n_gpu_layers") == 0:
        return True
    return m.engine in CPU_UNLESS_ASKED and not device.startswith("cuda")


@dataclass
class Pools:
    """What a node offers, by pool: its RAM, and each GPU (`gpus[i]` is GPU i when `indexed`, else the sum of
    every card of a node that reported only totals, which no copy can be pinned to)."""

    ram: int
    gpus: list[int]
    indexed: bool


def ram_pool(hb: Heartbeat) -> int:
    """The RAM models may use on a node: the worker's budget when it sets one, else 90 %; unknown is not refused."""
    if hb.mem_budget > 0:
        return hb.mem_budget
    return int(hb.mem_total * USABLE) if hb.mem_total else UNKNOWN_CAPACITY


def pools(hb: Heartbeat) -> Pools:
    """A node's pools at full room (nothing placed yet)."""
    if hb.gpu_memory:
        return Pools(ram_pool(hb), [int(g.total * USABLE) for g in hb.gpu_memory], True)
    return Pools(ram_pool(hb), [int(hb.vram_total * USABLE)] if hb.vram_total else [], False)


def capacity(hb: Heartbeat) -> int:
    """The most one GPU model can have on a node (every card together), or the RAM pool on a node without GPUs;
    a node that reports no memory at all is not refused anything."""
    if not (hb.vram_total or hb.gpu_memory or hb.mem_total or hb.mem_budget):
        return UNKNOWN_CAPACITY
    gpus = pools(hb).gpus
    return sum(gpus) if gpus else ram_pool(hb)
