"""A host of a host pool for tests: the commands a pools file names to start and stop a real OpenAI-compatible server
(coderai.testing.fake_openai, answering its name word by word), and that server.

- `python -m coderai.testing.fake_host start --port P --pidfile F --name N --record R [--hold]`: starts the server
  in a session of its own and returns at once (as `systemctl start` or `ssh host ...` would), appending
  `start N` to the record file R.
- `... stop --pidfile F --name N --record R`: SIGTERM to the server of the pidfile, waited for; `stop N` appended.
- The server answers `GET /stats` with `{"name", "requests", "held"}`; started with `--hold`, it holds each
  completion request that says `hold` until `POST /release` lets those held go on (so a test can kill it mid-request, or see where
  requests went).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from coderai.testing.fake_openai import FakeOpenAI, _Handler


class _HostHandler(_Handler):
    state: _State

    def do_GET(self) -> None:
        if self.path == "/stats":
            s = self.state
            return self._json(200, {"name": s.name, "requests": s.requests, "held": s.held})
        if self.path == "/v1/models":
            return self._json(200, {"object": "list", "data": [{"id": self.state.name, "object": "model"}]})
        super().do_GET()

    def do_POST(self) -> None:
        s = self.state
        if self.path == "/release":
            with s.lock:  # the requests held now go on; later ones are held again
                s.release.set()
                s.release = threading.Event()
            return self._json(200, {"released": True})
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.rfile = io.BytesIO(raw)  # read again by the fake server's handler
        hold = s.hold and b"hold" in raw
        with s.lock:
            s.requests += 1
            gate = s.release
            s.held += hold
        if hold:
            gate.wait()
            with s.lock:
                s.held -= 1
        super().do_POST()


class _State:
    def __init__(self, name: str, hold: bool) -> None:
        self.name, self.hold = name, hold
        self.requests = self.held = 0
        self.lock = threading.Lock()
        self.release = threading.Event()


def stats(base_url: str) -> dict[str, Any]:
    """The server's `/stats` (a test's poll)."""
    import urllib.request

    with urllib.request.urlopen(base_url + "/stats", timeout=5) as r:
        return json.loads(r.read())


def release(base_url: str) -> None:
    """Let the server's held requests go on."""
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(base_url + "/release", data=b"{}", method="POST"), timeout=5).close()


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie no longer does)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _record(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def _serve(a: argparse.Namespace) -> None:
    fake = FakeOpenAI(a.port, reply=a.name, usage=not a.no_usage)
    state = _State(a.name, a.hold)
    fake.server.RequestHandlerClass = type("Handler", (_HostHandler,), {"fake": fake, "state": state})
    Path(a.pidfile).write_text(str(os.getpid()))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"fake host {a.name} on port {fake.port}", flush=True)
    fake.server.serve_forever()


def _start(a: argparse.Namespace) -> None:
    argv = [sys.executable, "-m", "coderai.testing.fake_host", "serve", "--port", str(a.port)]
    argv += ["--pidfile", a.pidfile, "--name", a.name] + (["--hold"] if a.hold else [])
    argv += ["--no-usage"] if a.no_usage else []
    log = open(Path(a.pidfile).with_suffix(".log"), "ab")
    subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    _record(a.record, f"start {a.name}")


def _stop(a: argparse.Namespace) -> None:
    _record(a.record, f"stop {a.name}")
    try:
        pid = int(Path(a.pidfile).read_text())
    except (OSError, ValueError):
        return  # not running (never came up, or died)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.02)  # a helper process waiting for its server to end, not a test
    Path(a.pidfile).unlink(missing_ok=True)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m coderai.testing.fake_host")
    p.add_argument("what", choices=["start", "serve", "stop"])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--pidfile", required=True)
    p.add_argument("--name", default="host")
    p.add_argument("--record", default=os.devnull)
    p.add_argument("--hold", action="store_true")
    p.add_argument("--no-usage", action="store_true", help="report no usage (as some servers do)")
    a = p.parse_args()
    {"start": _start, "serve": _serve, "stop": _stop}[a.what](a)


if __name__ == "__main__":
    main()
