#!/usr/bin/env python3
"""The image's HEALTHCHECK: one script for every coderai service, which it recognises from the process list.

- gateway: `GET /healthz` answers 200 (it is 503 while the gateway has no NATS connection).
- metrics: `/metrics` answers at all (200, or 401 without the scrape token), and the process is connected to NATS.
- nats (nats-server run from this image, as compose/head.yml does): its monitoring `/healthz` on
  127.0.0.1:8222 (coderai-init writes that port) says the server and JetStream are up.
- router, scheduler, pod-broker, worker: a process of this container holds an ESTABLISHED TCP connection to
  the NATS port (from CODERAI_NATS_URL, else 4222). These services have no HTTP port; a live bus connection
  is what they need to work, and nats-py drops the socket when the server goes away.

Only the standard library; exits 0 when healthy, 1 (with one line saying why) when not.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

SERVICES = ("gateway", "router", "scheduler", "pod-broker", "metrics", "worker")
MODULES = {"coderai.gateway": "gateway", "coderai.router": "router", "coderai.scheduler": "scheduler",
           "coderai.pod_broker": "pod-broker", "coderai.metrics": "metrics", "coderai.engine_worker": "worker"}
ESTABLISHED = "01"
NATS_MONITOR_PORT = 8222  # coderai-init's default --nats-http-port


def service_of(argv: list[str]) -> str:
    """`coderai gateway ...` or `python -m coderai.gateway ...` -> "gateway", `nats-server ...` -> "nats";
    anything else -> ""."""
    if argv and os.path.basename(argv[0]) == "nats-server":
        return "nats"
    for i, arg in enumerate(argv):
        if os.path.basename(arg) == "coderai" and i + 1 < len(argv) and argv[i + 1] in SERVICES:
            return argv[i + 1]
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1].removesuffix(".__main__") in MODULES:
            return MODULES[argv[i + 1].removesuffix(".__main__")]
    return ""


def find_service(proc: Path = Path("/proc")) -> tuple[str, list[int]]:
    """The service this container runs and the pids of our processes (readable /proc entries). A coderai service
    wins over nats-server: compose/head.yml's scheduler shares the nats container's pid namespace (to reload it),
    and sees its process too."""
    found, pids = "", []
    for entry in sorted(proc.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        pids.append(int(entry.name))
        service = service_of([a.decode(errors="replace") for a in argv if a])
        if service and (not found or found == "nats"):
            found = service
    return found, pids


def socket_inodes(pids: list[int], proc: Path = Path("/proc")) -> set[str]:
    """Inodes of the sockets these processes hold (those whose fd table we may read)."""
    inodes: set[str] = set()
    for pid in pids:
        fd_dir = proc / str(pid) / "fd"
        try:
            fds = list(fd_dir.iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def established_to(port: int, inodes: set[str], tables: list[str]) -> bool:
    """Whether one of `inodes` is an ESTABLISHED TCP socket whose remote port is `port` (/proc/net/tcp format)."""
    for table in tables:
        for line in table.splitlines()[1:]:
            cols = line.split()
            if len(cols) < 10:
                continue
            remote, state, inode = cols[2], cols[3], cols[9]
            if state == ESTABLISHED and int(remote.rsplit(":", 1)[1], 16) == port and inode in inodes:
                return True
    return False


def nats_port(env: dict[str, str], service: str) -> int:
    """The port of the NATS URL this service was given (service-specific name first), else 4222."""
    svc = service.upper().replace("-", "_")
    url = env.get(f"CODERAI_{svc}_NATS_URL") or env.get("CODERAI_NATS_URL") or ""
    first = url.split(",")[0].strip()
    try:
        return (urlsplit(first).port if first else None) or 4222
    except ValueError:
        return 4222


def _setting(env: dict[str, str], service: str, name: str, default: str) -> str:
    svc = service.upper().replace("-", "_")
    return env.get(f"CODERAI_{svc}_{name}") or env.get(f"CODERAI_{name}") or default


def _http_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else (f"[{host}]" if ":" in host else host)


def check_http(url: str, ok_statuses: tuple[int, ...]) -> str:
    """'' when the URL answers with one of `ok_statuses`, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            status = r.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {exc}"
    return "" if status in ok_statuses else f"{url}: HTTP {status}"


def check_nats(service: str, pids: list[int], env: dict[str, str], proc: Path = Path("/proc")) -> str:
    port = nats_port(env, service)
    tables = []
    for name in ("tcp", "tcp6"):
        try:
            tables.append((proc / "net" / name).read_text())
        except OSError:
            pass
    if established_to(port, socket_inodes(pids, proc), tables):
        return ""
    return f"{service}: no established connection to NATS port {port}"


def main(env: dict[str, str] | None = None) -> int:
    env = dict(os.environ) if env is None else env
    service, pids = find_service()
    if not service:
        print("healthcheck: no coderai service runs in this container", file=sys.stderr)
        return 1
    if service == "nats":
        problem = check_http(f"http://127.0.0.1:{NATS_MONITOR_PORT}/healthz?js-enabled-only=true", (200,))
    elif service == "gateway":
        host = _http_host(_setting(env, service, "HOST", "127.0.0.1"))
        problem = check_http(f"http://{host}:{_setting(env, service, 'PORT', '8000')}/healthz", (200,))
    else:
        problem = ""
        if service == "metrics":
            host = _http_host(_setting(env, service, "HOST", "127.0.0.1"))
            problem = check_http(f"http://{host}:{_setting(env, service, 'PORT', '9464')}/metrics", (200, 401))
        problem = problem or check_nats(service, pids, env)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
