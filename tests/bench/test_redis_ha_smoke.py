"""bench/redis_ha.py --smoke runs end to end (so the bench cannot rot): every path measured, its table printed,
its servers gone afterwards. The numbers are not checked."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from coderai.testing.procs import processes_naming, run_interruptible

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_redis_ha_smoke_prints_its_table(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the bench's servers keep their files (and argv) under here
    r = run_interruptible([sys.executable, str(ROOT / "bench" / "redis_ha.py"), "--smoke"], 240, cwd=ROOT, env=env)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
    assert "## Limits check across heads" in r.stdout
    assert "| path | checks | achieved/s | p50 ms | p99 ms |" in r.stdout
    for path in ("redis", "sentinel", "kv-cas", "kv-counter"):
        assert f"| {path} | " in r.stdout, f"no row for {path}:\n{r.stdout}"
    assert "| redis | 200 |" in r.stdout  # 2 s at 100 checks/s, every check answered
    assert not processes_naming(str(tmp_path)), "the bench left servers running"
