"""die_with_parent: a child gets the asked signal when the thread that started it ends."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

from coderai.runtime.embedded import die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _start_from_a_thread(sig: int | None, script: str) -> subprocess.Popen:
    """Start `python -c script` from a thread that ends right after, as a worker's thread dies with it."""
    started: list[subprocess.Popen] = []

    def starter():
        preexec = die_with_parent(sig) if sig is not None else die_with_parent()
        started.append(
            subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, preexec_fn=preexec)
        )  # prctl only
        started[0].stdout.readline()  # the child is past its signal set-up before the thread ends

    t = threading.Thread(target=starter)
    t.start()
    t.join()
    return started[0]


# children that wait for a signal and nothing else; one ignores SIGTERM, as a server whose graceful shutdown
# hangs does in effect
STUBBORN = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); signal.pause()"
PLAIN = "import signal; print('up', flush=True); signal.pause()"


def test_the_default_is_sigterm():
    child = _start_from_a_thread(None, PLAIN)
    assert child.wait(30) == -signal.SIGTERM


def test_a_child_that_could_hang_on_sigterm_asks_for_sigkill():
    child = _start_from_a_thread(signal.SIGKILL, STUBBORN)
    assert child.wait(30) == -signal.SIGKILL
