"""bench/overhead.py --smoke runs end to end (so the bench cannot rot); its numbers are not checked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from coderai.testing.procs import run_interruptible

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_overhead_smoke_prints_its_tables():
    pytest.importorskip("llama_cpp")
    r = run_interruptible([sys.executable, str(ROOT / "bench" / "overhead.py"), "--smoke"], 280, cwd=ROOT)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
    assert "## Real engine" in r.stdout and "## Pure orchestration" in r.stdout
    assert "| path | conc | stream | p50 ms |" in r.stdout
    assert "| coderai | 1 | no |" in r.stdout
    assert "| path | TTFT p50 ms |" in r.stdout
