"""The check that a test module left nothing behind (coderai.testing.leftovers, wired in tests/conftest.py): it
finds a child, an orphan, a namespace and a listening socket a test left, and kills or closes them; what a
session-scoped fixture started is not counted; a module that leaves a process errors, naming it, and the next
module runs clean."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from coderai.testing.leftovers import Snapshot, clean, left_behind, snapshot
from coderai.testing.netns import Lab, NetnsUnavailable
from coderai.testing.procs import processes_naming, wait_until

ROOT = Path(__file__).resolve().parents[2]
SLEEPER = "import signal; signal.pause()"  # a process that lives until it is killed


def _sleeper(tag: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SLEEPER, tag], stdin=subprocess.DEVNULL, **kw)


def test_a_child_left_running_is_found_and_killed():
    before = snapshot()
    tag = uuid.uuid4().hex
    child = _sleeper(tag, start_new_session=True)
    try:
        left = left_behind(before, Snapshot(), grace_s=0)
        assert [cmd for cmd in left.processes.values() if tag in cmd], left.describe()
        assert tag in left.describe()
        clean(left)  # killed, and reaped (a zombie would hold nothing, but fills the process table)
        assert not processes_naming(tag) and not Path(f"/proc/{child.pid}").exists()
    finally:
        child.kill()
        child.wait()


def test_an_orphan_whose_parent_is_gone_is_found_by_its_home():
    """A shell that starts a sleeper in the background and exits: the sleeper is init's now, no descendant of
    this process, and is found all the same (its HOME is the suite's)."""
    before = snapshot()
    tag = uuid.uuid4().hex
    shell = subprocess.run(
        ["sh", "-c", f'{sys.executable} -c "{SLEEPER}" {tag} >/dev/null 2>&1 & echo $!'],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    orphan = int(shell.stdout.strip())
    try:
        wait_until(lambda: processes_naming(tag), 10, "the orphan to run")
        left = left_behind(before, Snapshot(), grace_s=0)
        assert orphan in {pid for pid, _ in left.processes}, left.describe()
        clean(left)
        wait_until(lambda: not processes_naming(tag), 10, "the orphan to be killed")
    finally:
        try:
            os.kill(orphan, 9)
        except ProcessLookupError:
            pass


def test_what_runs_before_or_outlives_the_module_and_what_exits_in_its_grace_are_not_counted():
    tag = uuid.uuid4().hex
    old = _sleeper(tag)
    try:
        before = snapshot()
        assert not left_behind(before, Snapshot(), grace_s=0)
        young = _sleeper(tag)  # as a session-scoped fixture's server, started while the module runs
        outliving = snapshot().minus(before)
        assert list(outliving.processes) and not left_behind(before, outliving, grace_s=0)
        young.terminate()  # on its way out: gone within the grace
        assert not left_behind(before, Snapshot(), grace_s=5)
        young.wait()
    finally:
        old.kill()
        old.wait()


def test_a_listening_socket_left_open_is_found_and_stops_listening():
    before = snapshot()
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        left = left_behind(before, Snapshot(), grace_s=0)
        assert list(left.listening.values()) == [port], left.describe()
        clean(left)
        assert not left_behind(before, Snapshot(), grace_s=0)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_a_namespace_a_lab_left_is_found_and_deleted():
    if not os.environ.get("CODERAI_TEST_NETNS_DIR"):
        pytest.skip("run under the suite's conftest")
    before = snapshot()
    try:
        lab = Lab(["leak"])
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    try:
        name = lab["leak"].name
        left = left_behind(before, Snapshot(), grace_s=0)
        assert name in left.namespaces and lab.hub in left.namespaces, left.describe()
        clean(left)
        assert not Path("/run/netns", name).exists() and not left_behind(before, Snapshot(), grace_s=0)
    finally:
        lab.close()


@pytest.mark.slow  # a whole inner pytest run, and the check's grace (5 s) for the leftover to go by itself
def test_a_module_that_leaves_a_process_errors_naming_it_and_the_next_module_runs_clean(tmp_path):
    """An inner pytest run laid out as this suite is (the suite's own conftest in tests/, below the rootdir): the
    first module leaves a sleeper (its tests pass) and, after a first test that needs nothing, starts the session's
    nats-server (which outlives it, and is not counted, though the module's check began before it); the second
    module finds nothing of the first's."""
    if not shutil.which("nats-server") and not (Path(sys.executable).parent / "nats-server").exists():
        pytest.skip("no nats-server")
    tag = uuid.uuid4().hex
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", tests / "conftest.py")
    (tests / "test_a_leaky.py").write_text(
        "import subprocess, sys\n\n\n"
        "def test_first_needs_nothing():\n    pass\n\n\n"
        "def test_leaks(nats_server):\n"
        f"    subprocess.Popen([sys.executable, '-c', {SLEEPER!r}, {tag!r}], start_new_session=True)\n\n\n"
        "def test_after_it():\n    pass\n"
    )
    (tests / "test_b_next.py").write_text(
        "from coderai.testing.procs import processes_naming\n\n\n"
        f"def test_nothing_of_the_first_runs():\n    assert not processes_naming({tag!r})\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rE", str(tmp_path)],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    out = r.stdout + r.stderr
    assert "4 passed, 1 error" in out, out
    assert "ERROR at teardown of test_after_it" in out and "test_a_leaky.py left behind" in out, out
    assert tag in out and "nats-server" not in out.split("left behind")[1], out
    assert not processes_naming(tag)
