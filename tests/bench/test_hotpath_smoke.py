"""bench/hotpath.py --smoke samples every service of a real stack under load and prints where the time went (so
the profiler cannot rot). Its numbers are not checked; that each service was sampled and named is."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from coderai.testing.procs import run_interruptible

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_profile_smoke_names_each_service_and_its_frames():
    if shutil.which("py-spy", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("py-spy is not installed (the dev extra brings it)")
    r = run_interruptible([sys.executable, str(ROOT / "bench" / "hotpath.py"), "--smoke"], 280, cwd=ROOT)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
    for service in ("gateway", "router", "worker-echo", "metrics"):
        assert f"| {service} |" in r.stdout, r.stdout[-3000:]
    assert "## gateway:" in r.stdout and "| own % | frame |" in r.stdout
