"""bench/engine.py --smoke runs end to end (so the bench cannot rot); its numbers are not checked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from coderai.testing.procs import run_interruptible

from coderai.runtime.embedded import find_llama_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_engine_bench_smoke_prints_its_table():
    pytest.importorskip("llama_cpp")
    if find_llama_server() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    r = run_interruptible([sys.executable, str(ROOT / "bench" / "engine.py"), "--smoke"], 280, cwd=ROOT)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
    assert "| path | conc | tokens/s | rounds' range | vs baseline |" in r.stdout
    for path in ("bare", "server", "inproc"):
        assert f"| {path} | 1 |" in r.stdout and f"| {path} | 2 |" in r.stdout


@pytest.mark.slow
def test_a_full_length_run_writes_every_requests_whole_max_tokens(tmp_path):
    """`--full-length` biases the end-of-text token off (read from the GGUF) on every path, coderai's included:
    every request then writes its whole max_tokens (16 in a smoke run), so tokens/s measures serving alone."""
    import json

    if find_llama_server() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    out = tmp_path / "cells.json"
    r = run_interruptible(
        [sys.executable, str(ROOT / "bench" / "engine.py"), "--smoke", "--paths", "bare,server", "--full-length"]
        + ["--json", str(out)],
        280,
        cwd=ROOT,
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
    cells = json.loads(out.read_text())
    assert {c["path"] for c in cells} == {"bare", "server"}
    assert all(c["requests"] > 0 and c["errors"] == 0 and c["tokens"] == 16 * c["requests"] for c in cells), cells
