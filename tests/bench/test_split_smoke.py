"""bench/split.py --smoke runs end to end over two network namespaces (so the bench cannot rot); its numbers are
not checked, only that every engine answered the same text as the whole model."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from coderai.testing.procs import run_interruptible

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_split_smoke_prints_its_table():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("the bench puts its two hosts in network namespaces: needs root and iproute2")
    r = run_interruptible([sys.executable, str(ROOT / "bench" / "split.py"), "--smoke"], 240, cwd=ROOT)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
    assert "| engine | c | tokens/s (aggregate) | ratio to local |" in r.stdout
    for engine in ("local", "layer", "row", "layer, no gate"):
        for c in (1, 8):
            row = next((ln for ln in r.stdout.splitlines() if ln.startswith(f"| {engine} | {c} | ")), "")
            assert "| yes |" in row, r.stdout
