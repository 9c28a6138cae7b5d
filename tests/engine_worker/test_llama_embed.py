"""The llama.cpp engine serving embeddings from a tiny random GGUF: shapes, norms, determinism, `dimensions`.

The weights are random, so nothing here checks meaning; test_embed_engine.py does that with real MiniLM weights.
"""

from __future__ import annotations

import numpy as np
import pytest

from coderai.contracts import ModelConfig
from coderai.contracts.media import EmbedJob
from coderai.engine_worker.engines import BadInput, EngineLoadError, engine_class
from coderai.engine_worker.engines.base import CancelFlag

pytestmark = pytest.mark.slow
llama_cpp = pytest.importorskip("llama_cpp")

DIM = 64  # build_tiny_gguf's default width
TEXTS = ["def main():", "import os, sys", "class Foo(Bar):"]


def make(path, ops=(), **params):
    e = engine_class("llama")(
        ModelConfig(
            name="e", engine="llama", path=str(path), ops=list(ops), params={"n_ctx": 256, "n_threads": 2, **params}
        )
    )
    e.load()
    return e


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    e = make(tiny_gguf, embedding=True)
    yield e
    e.close()


def embed(engine, texts, dimensions=None):
    job = EmbedJob(request_id="r", model="e", input=texts, dimensions=dimensions)
    res, usage = engine.embed(job, CancelFlag(), None)
    return res, np.frombuffer(res.vectors, dtype="<f4").reshape(res.count, res.dim), usage


def test_one_unit_vector_per_text(engine):
    res, vecs, _ = embed(engine, TEXTS)
    assert (res.count, res.dim) == (3, DIM) and len(res.vectors) == 3 * DIM * 4
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert not np.allclose(vecs[0], vecs[1])


def test_mean_pooling_is_the_default_for_a_gguf_that_names_none(engine):
    assert engine.llm.pooling_type() == llama_cpp.LLAMA_POOLING_TYPE_MEAN


def test_vectors_are_deterministic_whatever_the_batch(engine):
    _, first, _ = embed(engine, TEXTS)
    _, again, _ = embed(engine, TEXTS)
    _, alone, _ = embed(engine, [TEXTS[1]])
    assert np.array_equal(first, again)
    assert np.allclose(alone[0], first[1], atol=1e-5)


def test_more_texts_than_one_chunk_keep_their_order(engine):
    texts = [f"x = {i}" for i in range(20)]  # over EMBED_CHUNK, so two llama.cpp calls
    _, vecs, _ = embed(engine, texts)
    _, last, _ = embed(engine, [texts[-1]])
    assert vecs.shape == (20, DIM) and np.allclose(vecs[-1], last[0], atol=1e-5)


def test_usage_counts_the_model_tokens(engine):
    _, _, usage = embed(engine, TEXTS)
    expected = sum(len(engine.llm.tokenize(t.encode())) for t in TEXTS)
    assert (usage.prompt_tokens, usage.total_tokens) == (expected, expected) and expected > len(TEXTS)


def test_dimensions_truncate_and_renormalise(engine):
    _, full, _ = embed(engine, TEXTS)
    res, short, _ = embed(engine, TEXTS, dimensions=16)
    assert res.dim == 16 and np.allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)
    assert np.allclose(short, full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True), atol=1e-5)


@pytest.mark.parametrize(
    ("texts", "dimensions", "param"),
    [
        (TEXTS, 0, "dimensions"),
        (TEXTS, DIM + 1, "dimensions"),
        (["ok", ""], None, "input"),
        ([], None, "input"),
    ],
)
def test_bad_input(engine, texts, dimensions, param):
    with pytest.raises(BadInput) as err:
        embed(engine, texts, dimensions)
    assert err.value.param == param


def test_ops_embed_alone_loads_for_embeddings(tiny_gguf):
    e = make(tiny_gguf, ops=["embed"], pooling="last")
    try:
        assert e.embedding and e.llm.pooling_type() == llama_cpp.LLAMA_POOLING_TYPE_LAST
        assert embed(e, ["hello"])[0].dim == DIM
    finally:
        e.close()


def test_a_chat_model_refuses_to_embed(tiny_gguf):
    e = make(tiny_gguf)
    try:
        with pytest.raises(BadInput, match="embedding = true") as err:
            embed(e, ["hello"])
        assert err.value.param == "model"
    finally:
        e.close()


def test_per_token_pooling_is_refused_at_load(tiny_gguf):
    with pytest.raises(EngineLoadError, match="no single vector"):
        make(tiny_gguf, embedding=True, pooling="none")
