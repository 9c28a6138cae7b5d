"""What a test left behind: the suite's processes, the network namespaces its labs made, and the sockets this
process listens on. tests/conftest.py takes a `snapshot` when a test module starts and another when the module's
own fixtures are torn down; whatever is new, less what a session-scoped fixture started meanwhile, is a leftover:
named in an error, then killed or closed, so the next module starts clean.

The suite's processes are this process's descendants and, since a killed parent's children are handed to init,
every process whose `HOME` is the suite's own (tests/conftest.py gives the suite a new home, and every process a
test starts inherits it): an orphan a test left is found, another run's processes never are."""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from coderai.testing.netns import delete_namespace, noted_namespaces

# helpers a library starts once and keeps for the life of the process that loaded it: not a test's leftover
LIBRARY_HELPERS = (
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
    "joblib.externals.loky",
    "torch/_inductor/compile_worker",
)


@dataclass(frozen=True)
class Snapshot:
    """Processes by (pid, start time) (a pid alone may be reused) with their command lines, namespaces by name,
    and listening TCP sockets of this process by inode with their port."""

    processes: dict[tuple[int, int], str] = field(default_factory=dict)
    namespaces: frozenset[str] = frozenset()
    listening: dict[int, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.processes or self.namespaces or self.listening)

    def minus(self, *others: Snapshot) -> Snapshot:
        """What this holds and none of `others` does."""
        return Snapshot(
            {k: v for k, v in self.processes.items() if not any(k in o.processes for o in others)},
            self.namespaces.difference(*(o.namespaces for o in others)),
            {k: v for k, v in self.listening.items() if not any(k in o.listening for o in others)},
        )

    def plus(self, other: Snapshot) -> Snapshot:
        return Snapshot(
            self.processes | other.processes, self.namespaces | other.namespaces, self.listening | other.listening
        )

    def describe(self) -> str:
        lines = [f"process {pid}: {cmd[:300]}" for (pid, _), cmd in sorted(self.processes.items())]
        lines += [f"network namespace {name}" for name in sorted(self.namespaces)]
        lines += [f"a socket of this process listening on port {port}" for port in sorted(self.listening.values())]
        return "\n".join(lines)


def proc_stats() -> dict[int, list[str]]:
    """Every process's /proc/<pid>/stat fields after its name (state, ppid, ..., as `man 5 proc` numbers them from
    3), zombies included."""
    out: dict[int, list[str]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        out[int(entry.name)] = stat[stat.rfind(")") + 2 :].split()
    return out


def snapshot(home: str | None = None) -> Snapshot:
    """What runs now: the suite's processes (descendants of this one, and those whose HOME is `home`, by default
    this process's `HOME`), but zombies and `LIBRARY_HELPERS`; the noted namespaces that exist; this process's
    listening TCP sockets. Reads /proc only: it starts nothing, so it never sees itself."""
    home_entry = f"HOME={home or os.environ.get('HOME', '')}".encode()
    me = os.getpid()
    stats = {
        pid: (int(f[1]), int(f[19])) for pid, f in proc_stats().items() if f[0] not in ("Z", "X")
    }  # pid -> (ppid, start time), live processes only
    ours: set[int] = set()
    for pid in stats:
        chain, p = [], pid
        while p in stats and p not in ours and p != me and len(chain) < 64:
            chain.append(p)
            p = stats[p][0]
        if p == me or p in ours:
            ours.update(chain)
        elif pid != me:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if home_entry in environ:
                ours.add(pid)
    processes = {}
    for pid in ours:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if not any(helper in cmd for helper in LIBRARY_HELPERS):
            processes[(pid, stats[pid][1])] = cmd
    return Snapshot(processes, frozenset(noted_namespaces()), _listening())


def _listening() -> dict[int, int]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    found = {}
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and int(cols[9]) in inodes:  # 0A: LISTEN
                found[int(cols[9])] = int(cols[1].rsplit(":", 1)[1], 16)
    return found


def left_behind(before: Snapshot, outliving: Snapshot, grace_s: float = 5.0, home: str | None = None) -> Snapshot:
    """What runs now that did not `before`, less what is meant to `outlive` the module. Something on its way out
    (a browser's helper after its browser quit) gets `grace_s` to go: only what is still there counts."""
    deadline = time.monotonic() + grace_s
    while True:
        left = snapshot(home).minus(before, outliving)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def clean(left: Snapshot) -> None:
    """SIGKILL the processes (their process groups too), delete the namespaces, and stop the sockets listening.
    A socket is shut down through a duplicate of its descriptor, never closed: its owner still holds the number,
    and closing it under the owner would let the number name some other file later."""
    killed = []
    for pid, started in left.processes:
        if _start_time(pid) != started:
            continue  # gone, and the pid reused
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        killed.append(pid)
    deadline = time.monotonic() + 2
    while killed and time.monotonic() < deadline:  # this process's children reaped, not left zombies
        for pid in list(killed):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    killed.remove(pid)
            except ChildProcessError:
                killed.remove(pid)  # not a child: init reaps it
        time.sleep(0.02)
    for name in left.namespaces:
        delete_namespace(name)
    if left.listening:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in left.listening:
                try:
                    with socket.socket(fileno=os.dup(int(fd))) as dup:
                        dup.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2 :].split()[19])
