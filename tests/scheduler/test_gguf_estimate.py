"""The memory a GGUF copy is placed for comes from its header: tensor data + KV cache + compute overhead."""

from __future__ import annotations

import pytest

from coderai.contracts import ModelConfig
from coderai.sizing import DEFAULT_N_CTX, MB, OVERHEAD, SERVER_PARALLEL, estimate, estimate_bytes

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """A tiny llama with grouped-query attention (2 KV heads for 4 query heads) and a 4096-token training context."""
    from coderai.tiny_models.llm import build_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "gqa.gguf"
    shape = build_tiny_gguf(path, dim=64, layers=3, heads=4, kv_heads=2, ctx=4096)
    return path, shape


def cfg(path, engine: str = "llama-server", **params) -> ModelConfig:
    return ModelConfig(name="m", engine=engine, path=str(path), params=params)


def expected_kv(
    n_ctx: int, layers: int = 3, kv_heads: int = 2, head_dim: int = 16, k_bytes: float = 2, v_bytes: float = 2
) -> int:
    return int(layers * n_ctx * kv_heads * head_dim * k_bytes + layers * n_ctx * kv_heads * head_dim * v_bytes)


def test_weights_are_the_tensor_data_and_the_kv_cache_is_llama_servers_whole_context(grouped):
    path, shape = grouped
    reader = gguf.GGUFReader(str(path))
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    got = estimate(cfg(path, n_ctx=512, parallel=2))
    assert got.source == "gguf"
    assert got.weights == sum(int(t.n_bytes) for t in reader.tensors) < shape["bytes"]
    assert got.kv_cache == expected_kv(512 * 2)  # --ctx-size is n_ctx x parallel
    assert got.overhead == OVERHEAD + n_vocab * 512 * 4  # the logits of one 512-token micro-batch
    assert estimate_bytes(cfg(path, n_ctx=512, parallel=2)) == got.total == got.weights + got.kv_cache + got.overhead
    assert estimate(cfg(path)).kv_cache == expected_kv(DEFAULT_N_CTX * SERVER_PARALLEL)


def test_the_in_process_engine_holds_one_context_and_zero_means_the_trained_one(grouped):
    path, _ = grouped
    assert estimate(cfg(path, "llama")).kv_cache == expected_kv(DEFAULT_N_CTX)
    assert estimate(cfg(path, "llama", n_ctx=1024)).kv_cache == expected_kv(1024)
    assert estimate(cfg(path, "llama", n_ctx=0)).kv_cache == expected_kv(4096)


def test_a_quantized_cache_type_shrinks_the_kv_cache(grouped):
    path, _ = grouped
    q8 = 34 / 32
    assert estimate(cfg(path, n_ctx=512, parallel=1, cache_type_k="q8_0")).kv_cache == expected_kv(512, k_bytes=q8)
    assert estimate(cfg(path, "llama", n_ctx=512, type_k=8, type_v=8)).kv_cache == expected_kv(
        512, k_bytes=q8, v_bytes=q8
    )


def test_memory_mb_still_wins_and_a_file_size_given_keeps_the_old_rule(grouped):
    path, _ = grouped
    assert estimate(ModelConfig(name="m", engine="llama", path=str(path), memory_mb=900)).total == 900 * MB
    assert estimate_bytes(cfg(path), file_size=1000 * MB) == int(1000 * MB * 1.2) + OVERHEAD
    assert estimate(ModelConfig(name="m", engine="embed", path=str(path))).source == "file size"


def test_the_engines_defaults_are_the_ones_sizing_assumes():
    from coderai.engine_worker.engines import llama, llama_server

    assert (llama_server.DEFAULT_PARALLEL, llama_server.DEFAULT_N_CTX) == (SERVER_PARALLEL, DEFAULT_N_CTX)
    assert llama.DEFAULTS["n_ctx"] == DEFAULT_N_CTX


def test_a_real_k_quant_gguf_gets_a_sane_estimate():
    from coderai.testing.real_gguf import MISSING, gemma3_q4km

    try:
        path = gemma3_q4km()
    except ImportError:
        pytest.skip(MISSING)
    got = estimate(ModelConfig(name="g", engine="llama", path=str(path), params={"n_ctx": 2048}))
    size = path.stat().st_size
    assert got.source == "gguf"
    assert 0.9 * size < got.weights < size  # Q4_K_M tensors: the file less its header (the 262k-token vocabulary)
    assert got.kv_cache == 18 * 2048 * 1 * 256 * 2 * 2  # 18 layers, 1 KV head of 256, f16 K and V
    assert got.overhead == OVERHEAD + 262_144 * 512 * 4  # llama.cpp reports a 514.5 MiB CPU compute buffer
    assert 700 * MB < got.total < 1200 * MB
