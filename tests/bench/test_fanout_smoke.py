"""bench/fanout.py --smoke runs end to end (so the bench cannot rot); its numbers are not checked."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from coderai.testing.procs import run_interruptible

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_fanout_smoke_prints_its_tables():
    for mod in ("sentence_transformers", "diffusers", "rapidocr", "pypdfium2", "PIL"):
        pytest.importorskip(mod)
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the bench pins its two workers to two cores")
    r = run_interruptible([sys.executable, str(ROOT / "bench" / "fanout.py"), "--smoke"], 280, cwd=ROOT)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
    assert "| modality | items/request | 1 worker items/s | 2 workers items/s | ratio |" in r.stdout
    for modality in ("embeddings", "ocr", "images"):
        row = next((ln for ln in r.stdout.splitlines() if ln.startswith(f"| {modality} | ")), "")
        assert "fanout 1" in row, r.stdout  # with two holders the one measured request was split
    assert "| modality | workers | w1 | w2 | rest of stack | outside | steal |" in r.stdout
