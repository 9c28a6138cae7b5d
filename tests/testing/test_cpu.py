"""`OutsideLoad` tells this run's CPU from others': a failover's 10 s target is judged only on a machine that was
the suite's."""

from __future__ import annotations

import os
import subprocess
import sys

from coderai.testing.cpu import OutsideLoad, _tree_jiffies


def test_cpu_a_child_used_counts_as_this_runs():
    hz = os.sysconf("SC_CLK_TCK")
    before = _tree_jiffies(os.getpid())
    with OutsideLoad() as load:  # a child busy for half a second of CPU, reaped: its time is ours
        subprocess.run(
            [sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"],
            check=True,
            timeout=120,
        )
    assert _tree_jiffies(os.getpid()) - before >= 0.4 * hz
    assert 0.0 <= load.share <= 1.0


def test_on_an_xdist_worker_the_run_is_the_controllers_tree(monkeypatch):
    """Two workers are one run: the other worker's tests (children of the same controller) are not outside load."""
    from coderai.testing.cpu import _run_root

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert _run_root() == os.getpid()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert _run_root() == os.getppid()
    assert _tree_jiffies(_run_root()) >= _tree_jiffies(os.getpid())  # the controller's tree holds this process's
