"""Facts about this machine: a stable node id, memory, and the heartbeat built from them."""

from __future__ import annotations

import os
import re
import secrets
import socket
import time
from pathlib import Path

from coderai import __version__
from coderai.contracts import EngineStatus, Heartbeat
from coderai.contracts.split import RpcServer


def stable_node_id(data_dir: str | os.PathLike, given: str = "") -> str:
    """The configured id, else one made once from the host name and kept in `<data_dir>/node_id`.

    Stable across restarts so that a rebooted node finds its assignment under the same key.
    """
    if given:
        return given
    path = Path(os.path.expanduser(data_dir)) / "node_id"
    if path.exists():
        return path.read_text().strip()
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0])[:32].strip("-") or "node"
    node_id = f"{host}-{secrets.token_hex(3)}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(node_id + "\n")
    return node_id


def memory() -> tuple[int, int]:
    """(total, available) bytes of RAM, from /proc/meminfo where there is one."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        total = int(info["MemTotal"].split()[0]) * 1024
        free = int(info.get("MemAvailable", info["MemFree"]).split()[0]) * 1024
        return total, free
    except (OSError, KeyError, ValueError):
        return 0, 0


def gpu_count() -> int:
    """NVIDIA GPUs on this machine (`nvidia-smi -L`), 0 without one; vLLM runs one rank on each."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def addresses(first: str = "") -> list[str]:
    """This machine's interface addresses (loopback and link-local left out), `first` (if any) first."""
    import ifaddr  # comes with zeroconf

    found: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            a = ip.ip if isinstance(ip.ip, str) else ip.ip[0]
            if not (a.startswith("127.") or a == "::1" or a.startswith("fe80")) and a not in found:
                found.append(a)
    return ([first] if first else []) + [a for a in found if a != first]


def build_heartbeat(node_id: str, seq: int, families: list[str], engines: list[EngineStatus], pod: str = "",
                    addrs: list[str] | None = None, rpc: RpcServer | None = None, gpus: int = 0) -> Heartbeat:
    total, free = memory()
    return Heartbeat(
        node_id=node_id,
        version=__version__,
        seq=seq,
        ts=time.time(),
        host=socket.gethostname(),
        capabilities=families,
        engines=engines,
        in_flight=sum(e.in_flight for e in engines),
        mem_total=total,
        mem_free=free,
        pod=pod,
        addrs=addrs or [],
        rpc=rpc,
        gpus=gpus,
    )
