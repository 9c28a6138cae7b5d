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
