"""Test hosts in Linux network namespaces, joined by one bridge: several "machines" on one box, for mDNS,
joining and failover tests. Needs root and iproute2. Addresses are private to the namespaces made here."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


class NetnsUnavailable(RuntimeError):
    """Not root, no `ip`, or the kernel refuses namespaces."""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {r.stderr.strip()}")


@dataclass(frozen=True)
class Host:
    name: str  # namespace
    ip: str
    dev: str

    def prefix(self) -> list[str]:
        """Put before a command to run it on this host."""
        return ["ip", "netns", "exec", self.name]


class Lab:
    """`hosts` namespaces with one veth each into a bridge that lives in a hub namespace."""

    def __init__(self, hosts: list[str], subnet: int | None = None) -> None:
        if os.geteuid() != 0 or not shutil.which("ip"):
            raise NetnsUnavailable("network namespaces need root and iproute2")
        tag = f"{os.getpid() % 10000}"
        self.subnet = subnet if subnet is not None else 100 + os.getpid() % 100
        self.hub = f"crhub{tag}"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
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
        except Exception:
            self.close()
            raise

    def _ns(self, name: str) -> None:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)  # a leftover of a crashed run
        _ip("netns", "add", name)
        self._made.append(name)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def run(self, host: str, argv: list[str], timeout_s: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.hosts[host].prefix() + argv, capture_output=True, text=True, timeout=timeout_s, env=env)

    def close(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
