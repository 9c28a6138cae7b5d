"""How much of the machine something outside this test run used while a measurement ran: a timing the suite
reports (a failover's recovery) is only judged against its target when the machine was the suite's, not shared
with another run, a build or `stress-ng` beside it. Reads /proc only."""

from __future__ import annotations

import os
import time
from pathlib import Path

from coderai.testing.leftovers import proc_stats


def _busy_jiffies() -> int:
    """CPU time every process of the machine used since boot (all of /proc/stat's first line but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)


def _tree_jiffies(root: int) -> int:
    """CPU time of `root` and every live process below it, with what their reaped children used."""
    stats = proc_stats()
    parents = {pid: int(f[1]) for pid, f in stats.items()}
    used = {pid: int(f[11]) + int(f[12]) + int(f[13]) + int(f[14]) for pid, f in stats.items()}  # u+s, children's
    total = 0
    for pid, jiffies in used.items():
        p, hops = pid, 0
        while p not in (root, 0, 1) and p in parents and hops < 64:
            p, hops = parents[p], hops + 1
        if p == root:
            total += jiffies
    return total


def _run_root() -> int:
    """The process whose tree is this test run: pytest's, or on an xdist worker the controller's (the parent of
    both workers: the other worker's tests are the same run, not load from outside)."""
    return os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()


class OutsideLoad:
    """`with OutsideLoad() as load: ...`, then `load.share`: the CPUs' worth that processes outside this test
    run's tree used meanwhile, as a share of the machine (0: all of it was ours or idle, 1: others kept every
    CPU busy)."""

    def __init__(self) -> None:
        self.share = 0.0

    def __enter__(self) -> "OutsideLoad":
        self._root = _run_root()
        self._t, self._busy, self._ours = time.monotonic(), _busy_jiffies(), _tree_jiffies(self._root)
        return self

    def __exit__(self, *_exc: object) -> None:
        hz = os.sysconf("SC_CLK_TCK")
        elapsed = max(1e-6, time.monotonic() - self._t) * hz * (os.cpu_count() or 1)
        outside = (_busy_jiffies() - self._busy) - (_tree_jiffies(self._root) - self._ours)
        self.share = max(0.0, min(1.0, outside / elapsed))
