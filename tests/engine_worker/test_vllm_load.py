"""The vLLM engine's load in the heartbeat (issue 44, item 3), against a real vLLM server on the tiny random HF llama
on the CPU: with two sequences a batch and five requests at once, its stats say two running, the rest waiting and
a KV share, read from vLLM's own /metrics by the engine's poll; idle again, zeros; closed, the poll has stopped.

vLLM lives in a venv of its own (see test_vllm_engine.py)."""

from __future__ import annotations

import threading

import pytest

from coderai.contracts import CompletionJob, ModelConfig, SamplingParams
from coderai.engine_worker.engines import engine_class
from coderai.engine_worker.engines.base import CancelFlag
from coderai.engine_worker.engines.vllm import find_vllm_python
from coderai.testing.procs import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

VLLM_PYTHON = find_vllm_python()
if VLLM_PYTHON is None:
    pytest.skip("no vLLM venv: scripts/setup makes one (.venv/vllm) with the dev extra", allow_module_level=True)

EOS = "2"  # the tiny llama's end of sequence: biased away, so each request runs its whole max_tokens


def test_a_vllm_engine_reports_its_running_and_waiting_requests_and_kv_share():
    pytest.importorskip("transformers")
    from coderai.testing.tiny_hf_llama import tiny_hf_llama

    params = {
        "python": VLLM_PYTHON,
        "dtype": "bfloat16",
        "max_model_len": 2048,
        "max_num_seqs": 2,  # a batch of two: the others wait in vLLM's own queue
        "enforce_eager": True,
        "load_timeout_s": 600,
        "env": {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
    }
    eng = engine_class("vllm")(ModelConfig(name="tiny", engine="vllm", path=str(tiny_hf_llama()), params=params))
    eng.load()
    cancel = CancelFlag()
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        job = CompletionJob(
            request_id=f"r{i}",
            model="tiny",
            prompt="def f():" * 50,
            params=SamplingParams(max_tokens=1200, temperature=0, logit_bias={EOS: -100.0}),
        )
        try:
            eng.complete(job, cancel, lambda *_a, **_k: None)
        except BaseException as exc:
            errors.append(exc)

    def busy():
        if errors:
            raise AssertionError(f"a request failed: {errors[0]!r}")
        s = eng.stats()
        return s if s["slots_busy"] == 2 and s["queued"] >= 1 and s["kv_used"] > 0 else None

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(5)]
    try:
        for t in threads:
            t.start()
        stats = wait_until(busy, 120, "two running, the rest waiting and a KV share, in the engine's stats")
        print(
            f"vLLM with five asking two: {stats['slots_busy']} running, {stats['queued']} waiting, kv {stats['kv_used']}"
        )
        assert 0 < stats["kv_used"] <= 1 and stats["queued"] <= 3
        cancel.set()  # the streams are dropped: vLLM aborts them
        for t in threads:
            t.join(60)
        assert not errors, errors
        wait_until(
            lambda: (eng.stats()["slots_busy"], eng.stats()["queued"], eng.stats()["kv_used"]) == (0, 0, 0), 60, "idle"
        )
    finally:
        cancel.set()
        eng.close()
    poll = eng.load_poll
    assert poll is not None and not poll._thread.is_alive()
