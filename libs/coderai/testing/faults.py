"""Faults to inject into a running stack, and what to read from its processes: a namespace with one link to this
host (to slow or drop that link: `tc netem` where the kernel has it, else nftables loss and a delaying TCP relay),
a small tmpfs to fill until writes fail, and each process tree's resident memory and open file descriptors. Needs root and iproute2 for the network and the
mount; every address used is private to the link made here."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from coderai.testing.netns import NetnsUnavailable, _ip, noted, unnoted


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
        link = cls(
            ns=f"crsoak{tag}", host_dev=f"sk{tag}h", ns_dev=f"sk{tag}n", host_ip=f"10.232.{n}.1", ns_ip=f"10.232.{n}.2"
        )
        subprocess.run(["ip", "netns", "del", link.ns], capture_output=True)  # a leftover of a crashed run
        subprocess.run(["ip", "link", "del", link.host_dev], capture_output=True)
        try:
            _ip("netns", "add", link.ns)
            noted(link.ns)
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

    def netem(self, delay_ms: int, jitter_ms: int = 0, loss_pct: float = 0.0) -> None:
        """Latency (and jitter) and loss on both directions of the link with `tc netem`, until `heal()`. Needs a
        kernel with sch_netem (`has_netem()`)."""
        spec = ["netem", "delay", f"{delay_ms}ms"] + ([f"{jitter_ms}ms"] if jitter_ms else [])
        if loss_pct:
            spec += ["loss", f"{loss_pct}%"]
        for netns, dev in ((None, self.host_dev), (self.ns, self.ns_dev)):
            _tc(netns, "qdisc", "replace", "dev", dev, "root", *spec)
        self._netem = True

    def drop(self, loss_pct: float) -> None:
        """Drop `loss_pct` % of the packets into and out of the namespace, at random, with nftables rules that
        live in the namespace only (this host's own rules are not touched), until `heal()`."""
        if not shutil.which("nft"):
            raise NetnsUnavailable("packet loss without netem needs nftables (apt-get install nftables)")
        n = int(loss_pct)
        rules = (
            f"table inet coderai_soak {{\n chain in {{ type filter hook input priority 0; "
            f'iifname "{self.ns_dev}" numgen random mod 100 < {n} drop; }}\n'
            f' chain out {{ type filter hook output priority 0; oifname "{self.ns_dev}" numgen random mod 100 < {n} drop; }}\n}}\n'
        )
        r = subprocess.run([*self.prefix(), "nft", "-f", "-"], input=rules, capture_output=True, text=True)
        if r.returncode != 0:
            raise NetnsUnavailable(f"nft: {r.stderr.strip()}")
        self._dropping = True

    def heal(self) -> None:
        """Take off whatever `netem` or `drop` put on."""
        if getattr(self, "_netem", False):
            for netns, dev in ((None, self.host_dev), (self.ns, self.ns_dev)):
                with contextlib.suppress(NetnsUnavailable):
                    _tc(netns, "qdisc", "del", "dev", dev, "root")
            self._netem = False
        if getattr(self, "_dropping", False):
            subprocess.run([*self.prefix(), "nft", "delete", "table", "inet", "coderai_soak"], capture_output=True)
            self._dropping = False

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True)  # its peer goes with it
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        unnoted(self.ns)


def has_netem() -> bool:
    """Whether this kernel has sch_netem (some VM kernels are built without it)."""
    probe = f"nq{os.getpid() % 100000}"
    if (
        subprocess.run(
            ["ip", "link", "add", probe, "type", "veth", "peer", "name", probe + "p"], capture_output=True
        ).returncode
        != 0
    ):
        return False
    try:
        return (
            subprocess.run(
                ["tc", "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms"], capture_output=True
            ).returncode
            == 0
        )
    finally:
        subprocess.run(["ip", "link", "del", probe], capture_output=True)


class DelayRelay:
    """A TCP relay on `listen` that forwards to `target`, holding every chunk `delay_s` (plus up to `jitter_s`
    either way, order kept) in both directions while a delay is set: link latency for one peer where the kernel
    has no netem. With no delay set it only forwards. Runs its own event loop in a thread."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.listen, self.target = listen, target
        self.delay_s = 0.0
        self.jitter_s = 0.0
        self._rng = random.Random(0)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="delay-relay", daemon=True)

    def start(self) -> "DelayRelay":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the delay relay did not start")
        return self

    def set_delay(self, delay_s: float, jitter_s: float = 0.0) -> None:
        self.delay_s, self.jitter_s = delay_s, jitter_s

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._client, *self.listen)
        self._ready.set()
        async with server:
            await self._stop.wait()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        pumps = [asyncio.create_task(self._pump(reader, up_writer)), asyncio.create_task(self._pump(up_reader, writer))]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for t in pumps:
            t.cancel()
        for w in (writer, up_writer):
            w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read chunks as they come; write each at its arrival time plus the delay, none before the one ahead."""
        line: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                at, data = await line.get()
                if data is None:
                    return
                wait = at - self._loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)  # the latency being made, not a wait for anything
                writer.write(data)
                await writer.drain()

        out = asyncio.create_task(deliver())
        last = 0.0
        try:
            while data := await reader.read(65536):
                jitter = self._rng.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s else 0.0
                last = max(self._loop.time() + max(0.0, self.delay_s + jitter), last)
                await line.put((last, data))
            await line.put((last, None))
            await out
        finally:
            out.cancel()


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
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(self.path)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise NetnsUnavailable(f"mount tmpfs: {r.stderr.strip()}")
        self.filler = self.path / ".soak-filler"

    def fill(self, chunk: int = 1 << 20) -> int:
        """Write one file until the filesystem is full (ENOSPC); the bytes written."""
        block = b"\0" * chunk
        written = 0
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                try:
                    written += os.write(fd, block)  # unbuffered: a short write just goes on with a smaller block
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if len(block) == 1:
                        return written
                    block = block[: max(1, len(block) // 16)]  # the last free pages too, a smaller block at a time
        finally:
            os.close(fd)

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


def fd_targets(pid: int) -> list[str]:
    """What each open fd of `pid`'s process tree is: a path, a pipe, or a TCP socket as its local and remote
    address (to tell a connection that stayed open from a pool's or a leak's)."""
    sockets: dict[str, str] = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                f = line.split()
                sockets[f[9]] = f"tcp {_addr(f[1])} -> {_addr(f[2])}"
    out = []
    for p in tree(pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
            for fd in os.listdir(f"/proc/{p}/fd"):
                with contextlib.suppress(FileNotFoundError):
                    target = os.readlink(f"/proc/{p}/fd/{fd}")
                    if target.startswith("socket:["):
                        target = sockets.get(target[8:-1], target)
                    out.append(target)
    return sorted(out)


def _addr(hexaddr: str) -> str:
    ip, port = hexaddr.split(":")
    if len(ip) == 8:
        ip = ".".join(str(int(ip[i : i + 2], 16)) for i in (6, 4, 2, 0))
    return f"{ip}:{int(port, 16)}"
