"""The in-process llama engine and tenants' caches (issue 40, item 8): a job never reuses the KV another key's job
left in the context, nor a RAM-cache entry; its own key's next job still does."""

from __future__ import annotations

import pytest

from coderai.contracts import ChatJob, ModelConfig, SamplingParams
from coderai.engine_worker.engines import engine_class
from coderai.engine_worker.engines.base import CancelFlag

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow

SYSTEM = " ".join(f"alpha{j}" for j in range(60)) + " the discount code is ZEBRA-42"


def _job(scope: str, question: str) -> ChatJob:
    return ChatJob(
        request_id="r",
        model="t",
        cache_scope=scope,
        params=SamplingParams(max_tokens=1, temperature=0.0),
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    )


def _reused(engine, job: ChatJob) -> int:
    before = engine.stats()["cached_tokens"]
    engine.chat(job, CancelFlag(), None)
    return engine.stats()["cached_tokens"] - before


@pytest.mark.parametrize("share_cache", [False, None])
def test_another_key_never_reuses_the_context(tiny_gguf, share_cache):
    cfg = ModelConfig(name="t", engine="llama", path=str(tiny_gguf), params={"n_ctx": 1024}, share_cache=share_cache)
    engine = engine_class("llama")(cfg)
    engine.load()
    try:
        assert (engine.llm.cache is None) is (share_cache is False)  # a private model loads without the RAM cache
        _reused(engine, _job("scope-a", "first"))
        bob = _reused(engine, _job("scope-b", "what is the code?"))
        print(f"share_cache={share_cache}: bob's right guess reused {bob} tokens")
        assert bob == 0
        assert engine.llm.cache is None  # dropped at the first scoped job, if the model had one
        _reused(engine, _job("scope-a", "first"))
        assert _reused(engine, _job("scope-a", "second")) > 20  # alice's own prefix, still reused
    finally:
        engine.close()
