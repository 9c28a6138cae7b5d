"""bench/burst.py --smoke runs end to end (so the bench cannot rot): cold starts of the small model through the
whole stack, the fake RunPod API and the local Hub-like server (one plain, two on a shared network volume, the
second finding the weights there), every phase measured and positive, the baselines measured, its servers gone
afterwards. The numbers themselves are not checked."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from coderai.testing.procs import processes_naming, run_interruptible

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("rent", "boot", "join", "fetch", "load", "first_token")
ORDER = ("request", "rented", "booted", "joined", "fetch_start", "fetch_done", "loaded", "first_token")


@pytest.mark.slow
def test_burst_smoke_measures_every_phase_of_a_cold_start(tmp_path):
    for mod in ("graphql", "llama_cpp", "gguf", "tokenizers"):
        pytest.importorskip(mod)
    out = tmp_path / "burst.json"
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the bench's servers keep their files (and argv) under here
    r = run_interruptible(
        [sys.executable, str(ROOT / "bench" / "burst.py"), "--smoke", "--json", str(out)], 240, cwd=ROOT, env=env
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-5000:]}"
    assert "| model | n | GGUF MB | rent | boot | join | fetch | load | first token |" in r.stdout
    assert "| small | 2 | " in r.stdout and "| small, weights on the volume | 1 | " in r.stdout
    rounds = {c["model"]: c for c in json.loads(out.read_text())["rounds"]}
    assert sorted(rounds) == ["small-1", "small-vol-1", "small-vol-2"]
    for name, cold in rounds.items():
        assert cold["pod"].startswith("coderai-") and set(cold["phases"]) == set(PHASES), name
        assert all(v > 0 for v in cold["phases"].values()), (name, cold["phases"])
        m = cold["milestones"]  # one after another, as a user waits through them
        assert [m[k] for k in ORDER] == sorted(m[k] for k in ORDER), (name, m)
        assert cold["total_s"] == pytest.approx(m["first_token"] - m["request"])
        assert cold["fetch_bytes"] > 0 and cold["warm_s"] > 0, name
    for name in ("small-1", "small-vol-1"):  # downloaded, and measured against a plain download
        assert rounds[name]["downloaded"] and 0 < rounds[name]["plain_get_s"] <= rounds[name]["plain_get_sha_s"]
    assert not rounds["small-vol-2"]["downloaded"]  # the weights were on the volume the pod before filled
    assert not processes_naming(str(tmp_path)), "the bench left servers running"
