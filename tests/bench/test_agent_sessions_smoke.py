"""bench/agent_sessions.py --quick replays the recorded Claude Code and Codex sessions end to end, so the benchmark
cannot rot: the table has its three rows, every ratio is a fraction, and prefix routing captures at least what
round-robin does. No timing is asserted."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from coderai.testing.procs import run_interruptible

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def test_agent_sessions_bench_quick():
    r = run_interruptible([sys.executable, str(ROOT / "bench" / "agent_sessions.py"), "--quick"], 240, cwd=ROOT)
    if "> no llama-server" in r.stdout or "> skipping" in r.stdout:
        pytest.skip(r.stdout.strip().splitlines()[-1])  # the routers venv is made by the full bench's first run
    assert r.returncode == 0, r.stderr[-3000:]
    ratios = {}
    for mode in ("coderai", "round_robin", "sglang_cache_aware"):
        row = re.search(rf"^\| {mode} \| ([0-9.]+) \|", r.stdout, re.M)
        assert row, r.stdout
        ratios[mode] = float(row.group(1))
    assert all(0 <= v <= 1 for v in ratios.values()), ratios
    assert ratios["coderai"] >= ratios["round_robin"], ratios
