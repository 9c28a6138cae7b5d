"""Test hosts in Linux network namespaces, joined by one bridge: several "machines" on one box, for mDNS,
joining and failover tests. Needs root and iproute2. Addresses are private to the namespaces made here.

Under the test suite every namespace made here (or by `faults.Link`) is also noted in `CODERAI_TEST_NETNS_DIR`
(tests/conftest.py sets it), by this process or by a bench it runs, so the suite finds one that a test left:
namespaces are global to the box, and another run's are none of its business."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path


class NetnsUnavailable(RuntimeError):
    """Not root, no `ip`, or the kernel refuses namespaces."""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {r.stderr.strip()}")


def _registry() -> Path | None:
    folder = os.environ.get("CODERAI_TEST_NETNS_DIR")
    return Path(folder) if folder else None


def noted(name: str) -> None:
    """Note a namespace just made (a no-op outside the test suite)."""
    if (folder := _registry()) is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).touch()


def unnoted(name: str) -> None:
    """Forget a namespace just deleted."""
    if (folder := _registry()) is not None:
        (folder / name).unlink(missing_ok=True)


def noted_namespaces() -> set[str]:
    """The noted namespaces that still exist (a crashed bench's are among them)."""
    folder = _registry()
    if folder is None or not folder.is_dir():
        return set()
    return {p.name for p in folder.iterdir() if Path("/run/netns", p.name).exists()}


def delete_namespace(name: str) -> None:
    """SIGKILL every process in namespace `name`, then delete it (its veth pairs go with it) and forget it."""
    r = subprocess.run(["ip", "netns", "pids", name], check=False, capture_output=True, text=True)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
    unnoted(name)


@dataclass(frozen=True)
class Host:
    name: str  # namespace
    ip: str
    dev: str

    def prefix(self) -> list[str]:
        """Put before a command to run it on this host."""
        return ["ip", "netns", "exec", self.name]


def _subnet() -> int:
    """A /24 of 10.231.0.0/16 for this process's labs: by its pid, and apart for each xdist worker of the suite
    (two workers' labs at once must not share a subnet: the root namespace would have two routes to it)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return 100 + (int(worker) % 3 if worker.isdigit() else 0) * 50 + os.getpid() % 50


class Lab:
    """`hosts` namespaces with one veth each into a bridge that lives in a hub namespace."""

    def __init__(self, hosts: list[str], subnet: int | None = None, reach: bool = False) -> None:
        """`reach`: the test's own process (the root namespace) gets an address on the bridge too, `root_ip`,
        so clients in the test talk to the hosts directly."""
        if os.geteuid() != 0 or not shutil.which("ip"):
            raise NetnsUnavailable("network namespaces need root and iproute2")
        tag = f"{os.getpid() % 10000}"
        self.subnet = subnet if subnet is not None else _subnet()
        self.hub = f"crhub{tag}"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        self._links: list[str] = []  # in the root namespace: gone with `close`
        try:
            self._ns(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, name in enumerate(hosts, start=1):
                ns, dev, peer = f"cr{name}{tag}", f"eth{i}", f"h{i}x{tag}"
                ip = f"10.231.{self.subnet}.{i}"
                self._ns(ns)
                tmp = f"v{i}x{tag}"
                _ip("link", "add", tmp, "type", "veth", "peer", "name", peer)
                _ip("link", "set", tmp, "netns", ns)
                _ip("-n", ns, "link", "set", tmp, "name", dev)
                _ip("link", "set", peer, "netns", self.hub)
                _ip("-n", self.hub, "link", "set", peer, "master", "br0")
                _ip("-n", self.hub, "link", "set", peer, "up")
                _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", dev)  # mDNS multicast leaves by this link
                self.hosts[name] = Host(ns, ip, dev)
            self.root_ip = ""
            if reach:
                self.root_ip, outside, inside = f"10.231.{self.subnet}.254", f"crr{tag}", f"crq{tag}"
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                self._links.append(outside)
                _ip("link", "set", inside, "netns", self.hub)
                _ip("-n", self.hub, "link", "set", inside, "master", "br0")
                _ip("-n", self.hub, "link", "set", inside, "up")
                _ip("addr", "add", f"{self.root_ip}/24", "dev", outside)
                _ip("link", "set", outside, "up")
        except Exception:
            self.close()
            raise

    def _ns(self, name: str) -> None:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)  # a leftover of a crashed run
        _ip("netns", "add", name)
        noted(name)
        self._made.append(name)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def run(
        self, host: str, argv: list[str], timeout_s: float = 60, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.hosts[host].prefix() + argv, capture_output=True, text=True, timeout=timeout_s, env=env
        )

    def popen(self, host: str, argv: list[str], log, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `argv` on `host` in the background, its output appended to the file `log`."""
        return subprocess.Popen(
            self.hosts[host].prefix() + argv,
            stdout=open(log, "ab"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )

    def pids(self, host: str) -> list[int]:
        r = subprocess.run(["ip", "netns", "pids", self.hosts[host].name], capture_output=True, text=True)
        return [int(p) for p in r.stdout.split()]

    def kill_all(self, host: str) -> int:
        """SIGKILL every process on `host`, as a machine losing its power would; how many there were."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def cut(self, host: str) -> None:
        """Take `host`'s link down: it reaches nobody and nobody reaches it, while its processes run on."""
        _ip("-n", self.hosts[host].name, "link", "set", self.hosts[host].dev, "down")

    def heal(self, host: str) -> None:
        _ip("-n", self.hosts[host].name, "link", "set", self.hosts[host].dev, "up")

    def close(self) -> None:
        for name in self.hosts:
            self.kill_all(name)
        for link in self._links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        self._links.clear()
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            unnoted(ns)
        self._made.clear()

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
