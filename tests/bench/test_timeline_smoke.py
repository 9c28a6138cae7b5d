"""bench/timeline.py --smoke joins real requests with the spans of every hop they took (so the latency breakdown
cannot rot). Its numbers are not checked; that each request's hops were found, in causal order, and add up to what
the client waited, is."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from coderai.testing.procs import run_interruptible

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

SEGMENTS = (
    "http in, auth, admission",
    "pick",
    "job over NATS",
    "worker and engine",
    "frames back, accounting",
    "answer out",
)


def test_timeline_smoke_splits_each_request_into_its_hops(tmp_path):
    out = tmp_path / "timeline.json"
    r = run_interruptible(
        [sys.executable, str(ROOT / "bench" / "timeline.py"), "--smoke", "--json", str(out)], 280, cwd=ROOT
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
    for name in SEGMENTS:
        assert f"| {name} |" in r.stdout, r.stdout[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) >= 15, f"only {len(rows)} of 20 requests were joined with their spans"
    for row in rows:
        assert all(row[name] >= 0 for name in SEGMENTS), row  # one clock, events in causal order
        assert abs(sum(row[name] for name in SEGMENTS) - row["total"]) < 0.01, row
