"""Faults to inject into a running stack, and what to read from its processes: a namespace with one link to this
host (to slow or drop that link with `tc netem`), a small tmpfs to fill until writes fail, process signals, and
each process tree's resident memory and open file descriptors. Needs root and iproute2 for the network and the
mount; every address used is private to the link made here."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from coderai.testing.netns import NetnsUnavailable, _ip


@dataclass
class Link:
    """Network namespace `ns` joined to this host by one veth pair: `host_ip` on `host_dev` here, `ns_ip` on
    `ns_dev` there (a /30 of 10.232.0.0/16). Services bound to `host_ip` are reachable from the namespace; a
    process started with `prefix()` runs inside it."""

    ns: str
    host_dev: str
    ns_dev: str
    host_ip: str
    ns_ip: str

    @classmethod
    def make(cls, tag: str, subnet: int | None = None) -> "Link":
        if os.geteuid() != 0 or not shutil.which("ip"):
            raise NetnsUnavailable("network namespaces need root and iproute2")
        n = subnet if subnet is not None else os.getpid() % 250
        link = cls(ns=f"crsoak{tag}", host_dev=f"sk{tag}h", ns_dev=f"sk{tag}n",
                   host_ip=f"10.232.{n}.1", ns_ip=f"10.232.{n}.2")
        subprocess.run(["ip", "netns", "del", link.ns], capture_output=True)  # a leftover of a crashed run
        subprocess.run(["ip", "link", "del", link.host_dev], capture_output=True)
        try:
            _ip("netns", "add", link.ns)
            _ip("link", "add", link.host_dev, "type", "veth", "peer", "name", link.ns_dev)
            _ip("link", "set", link.ns_dev, "netns", link.ns)
            _ip("addr", "add", f"{link.host_ip}/30", "dev", link.host_dev)
            _ip("link", "set", link.host_dev, "up")
            _ip("-n", link.ns, "addr", "add", f"{link.ns_ip}/30", "dev", link.ns_dev)
            _ip("-n", link.ns, "link", "set", link.ns_dev, "up")
            _ip("-n", link.ns, "link", "set", "lo", "up")
        except Exception:
            link.close()
            raise
        return link

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def impair(self, delay_ms: int, jitter_ms: int = 0, loss_pct: float = 0.0) -> None:
        """Latency (and jitter) and loss on both directions of the link, from now until `heal()`."""
        spec = ["netem", "delay", f"{delay_ms}ms"] + ([f"{jitter_ms}ms"] if jitter_ms else [])
        if loss_pct:
            spec += ["loss", f"{loss_pct}%"]
        for netns, dev in ((None, self.host_dev), (self.ns, self.ns_dev)):
            _tc(netns, "qdisc", "replace", "dev", dev, "root", *spec)

    def heal(self) -> None:
        for netns, dev in ((None, self.host_dev), (self.ns, self.ns_dev)):
            with contextlib.suppress(NetnsUnavailable):
                _tc(netns, "qdisc", "del", "dev", dev, "root")

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True)  # its peer goes with it
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


def _tc(netns: str | None, *args: str) -> None:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + ["tc", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(cmd)}: {r.stderr.strip()}")


class Tmpfs:
    """A tmpfs of `size_mb` mounted at `path` (root only): a data dir whose filesystem can be filled."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(self.path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise NetnsUnavailable(f"mount tmpfs: {r.stderr.strip()}")
        self.filler = self.path / ".soak-filler"

    def fill(self, chunk: int = 1 << 20) -> int:
        """Write one file until the filesystem is full (ENOSPC); the bytes written."""
        block = b"\0" * chunk
        written = 0
        with open(self.filler, "ab") as fh:
            while True:
                try:
                    fh.write(block)
                    fh.flush()
                    written += chunk
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if chunk == 1:
                        return written
                    chunk //= 16  # the last free pages too, a smaller block at a time
                    block = block[:chunk]

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def close(self) -> None:
        self.free()
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


# --- what a process tree holds -----------------------------------------------------------------------------------


def tree(pid: int) -> list[int]:
    """`pid` and every descendant process."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for tid in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(FileNotFoundError):
                    todo += [int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
    return out


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid`'s whole process tree."""
    total = 0
    for p in tree(pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def open_fds(pid: int) -> int:
    """Open file descriptors of `pid`'s whole process tree."""
    n = 0
    for p in tree(pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
            n += len(os.listdir(f"/proc/{p}/fd"))
    return n
