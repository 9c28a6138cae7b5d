"""The log budget (docs/architecture.md, "Logs"): at INFO an idle `coderai up` writes at most one line a minute per
service once it is ready; each request writes one JSON line when it completes; a client that disconnects, queued
or answering, streamed or not, is one INFO line on its request and never a traceback.

One real `coderai up` (every service a process, its own NATS and Redis) serving the tiny GGUF on llama-server,
whose load the worker polls twice a second, and the echo engine paced like a model (8 jobs at a time, the rest
queued), so clients can leave while their requests run and while they wait."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from coderai.runtime.embedded import find_llama_server, free_port
from coderai.testing.procs import deadline_scale, wait_until
from coderai.testing.stack import write_models_file

pytestmark = pytest.mark.slow

IDLE_WINDOW_S = 60.0
PACED = "paced"  # the echo engine, 0.05 s a token: 2000 tokens keep a slot for 100 s
SLOTS = 8  # jobs the paced echo engine runs at once (EchoEngine.max_concurrency)
_REDIS_QUIET = re.compile(r"^\d+:[A-Z] .{20,30} [.-] ")  # redis-server's debug (.) and verbose (-) lines


@pytest.fixture(scope="module")
def up(tmp_path_factory, tiny_gguf):
    root = tmp_path_factory.mktemp("log-budget")
    engine = "llama-server" if find_llama_server() else "llama"
    models = write_models_file(
        root / "models.toml",
        [
            {"name": "tiny", "engine": engine, "path": str(tiny_gguf), "params": {"n_ctx": 512, "n_threads": 1}},
            {"name": PACED, "engine": "echo", "path": "-", "params": {"token_delay_s": 0.05}},
        ],
    )
    port, out = free_port(), root / "up.log"
    env = os.environ | {"CODERAI_WORKER_FAMILIES": f"{engine},echo"}
    with open(out, "wb") as stdout:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "coderai.cli",
                "up",
                "--data-dir",
                str(root / "data"),
                "--port",
                str(port),
                "--metrics-port",
                str(free_port()),
                "--models-file",
                str(models),
            ],
            stdout=stdout,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    try:
        wait_until(lambda: "\nready" in out.read_text() or proc.poll() is not None, 180, "coderai up to print ready")
        assert proc.poll() is None, out.read_text()
        key = (root / "data" / "admin.key").read_text().strip()
        stack = Up(root, port, key, out)
        wait_until(lambda: {"tiny", PACED} <= stack.engines_ready(), 60, "both engines to be ready")
        yield stack
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    # a client's leaving cancels its job, whole or streamed, running or queued: nothing is left for the stop to
    # wait out (a paced whole answer once slept through its cancel, and the worker was killed after its drain)
    assert "did not stop in time" not in out.read_text(), out.read_text()[-2000:]


class Up:
    def __init__(self, root: Path, port: int, key: str, out: Path) -> None:
        self.root, self.port, self.key, self.out = root, port, key, out
        self.http = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {key}"}
        self.logs = root / "data" / "logs"

    def heartbeat_engines(self) -> list[dict]:
        nodes = httpx.get(f"{self.http}/admin/nodes", headers=self.headers, timeout=10).json()["nodes"]
        return [e for n in nodes for e in n["heartbeat"].get("engines", [])]

    def engines_ready(self) -> set[str]:
        return {e["model"] for e in self.heartbeat_engines() if e.get("state") == "ready"}

    def in_flight(self, model: str) -> int:
        return sum(e.get("in_flight", 0) for e in self.heartbeat_engines() if e["model"] == model)

    def files(self) -> dict[str, Path]:
        """Every log of the stack: each service's, nats-server's and redis-server's, and `coderai up`'s own."""
        return {p.stem: p for p in sorted(self.logs.glob("*.log"))} | {"up": self.out}

    def gateway_lines(self, after: int = 0) -> list[str]:
        return (self.logs / "gateway.log").read_text(errors="replace")[after:].splitlines()


def loud(line: str) -> bool:
    """Whether a log line is at INFO or above: a JSON line by its level, nats-server's and redis-server's by their
    marks; any other line (a traceback, a library's own text) counts."""
    if not line.strip():
        return False
    if line.startswith("{"):
        try:
            return json.loads(line).get("level") != "debug"
        except ValueError:
            return True
    return not (" [DBG] " in line or " [TRC] " in line or _REDIS_QUIET.match(line))


def test_an_idle_stack_writes_at_most_a_line_a_minute_per_service(up):
    files = up.files()
    marks = {name: path.stat().st_size for name, path in files.items()}

    def written() -> dict[str, list[str]]:
        new = {name: path.read_bytes()[marks[name] :].decode(errors="replace") for name, path in files.items()}
        return {name: [line for line in text.splitlines() if loud(line)] for name, text in new.items()}

    # the window the budget is about, polled each second: a service over it ends the wait (and fails) at once. The
    # window is the budget's minute, not a deadline: wait_until's scale for loaded machines is taken back out
    try:
        over = wait_until(
            lambda: {name: lines for name, lines in written().items() if len(lines) > 1},
            IDLE_WINDOW_S / deadline_scale(),
            "a service over its idle budget",
            interval_s=1.0,
        )
    except TimeoutError:
        over = {}
    assert not over, "over the idle budget of one INFO line a minute:\n" + "\n".join(
        f"{name}: {len(lines)} lines, e.g.\n  " + "\n  ".join(line[:300] for line in lines[:5])
        for name, lines in over.items()
    )


def test_a_request_is_one_json_line_when_it_completes(up):
    mark = len((up.logs / "gateway.log").read_text(errors="replace"))
    r = httpx.post(
        f"{up.http}/v1/chat/completions",
        headers=up.headers | {"X-Client-Request-Id": "budget-ok"},
        json={"model": PACED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    rid = r.headers["Coderai-Request-Id"]
    lines = wait_until(
        lambda: [json.loads(x) for x in up.gateway_lines(mark) if f'"request_id": "{rid}"' in x],
        10,
        "the completion line",
    )
    assert len(lines) == 1, lines
    done = lines[0]
    assert done["msg"] == "request completed" and done["level"] == "info", done
    assert (done["key_name"], done["model"], done["op"], done["status"], done["http_status"]) == (
        "admin",
        PACED,
        "chat",
        "ok",
        200,
    )
    assert done["engine"] and done["route"] and done["client_request_id"] == "budget-ok"
    assert done["completion_tokens"] == 3 and done["total_ms"] >= done["ttft_ms"] > 0
    assert up.key not in (up.logs / "gateway.log").read_text()


def _post(up: Up, client_id: str, stream: bool) -> socket.socket:
    """A chat request on a socket of its own, which the test closes to leave: a whole answer never sends a byte
    before it is done; a streamed one is read up to its first token by `_started`."""
    body = json.dumps(
        {"model": PACED, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 2000, "stream": stream}
    ).encode()
    s = socket.create_connection(("127.0.0.1", up.port), timeout=30)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer "
        + up.key.encode()
        + b"\r\nX-Client-Request-Id: "
        + client_id.encode()
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    return s


def _started(s: socket.socket) -> None:
    got = b""
    while b"data: " not in got:
        piece = s.recv(4096)
        assert piece, f"the stream ended before its first token: {got!r}"
        got += piece


def test_clients_that_leave_are_one_info_line_each_and_never_a_traceback(up):
    gateway = up.logs / "gateway.log"
    mark = len(gateway.read_text(errors="replace"))
    tag = f"leave-{time.monotonic_ns()}"
    socks: dict[str, socket.socket] = {}
    try:
        # every slot taken, half by streams that have started, half by whole answers being generated
        for i in range(SLOTS):
            socks[f"{tag}-run-{i}"] = _post(up, f"{tag}-run-{i}", stream=i % 2 == 0)
        for i in range(0, SLOTS, 2):
            _started(socks[f"{tag}-run-{i}"])
        wait_until(lambda: up.in_flight(PACED) >= SLOTS, 30, "every slot of the paced engine to be busy")
        # then four that wait in the queue, two streamed (no byte sent yet) and two whole
        for i in range(4):
            socks[f"{tag}-queued-{i}"] = _post(up, f"{tag}-queued-{i}", stream=i % 2 == 0)
        wait_until(lambda: up.in_flight(PACED) >= SLOTS + 4, 30, "four requests to queue")
    finally:
        for s in socks.values():
            s.close()

    def completed() -> dict[str, dict]:
        rows = [json.loads(x) for x in up.gateway_lines(mark) if '"msg": "request completed"' in x]
        return {r["client_request_id"]: r for r in rows if r.get("client_request_id", "").startswith(tag)}

    wait_until(lambda: len(completed()) == len(socks), 30, "every request that was left to complete as cancelled")
    lines = up.gateway_lines(mark)
    not_json = [x for x in lines if not x.startswith("{")]
    assert not not_json, "the gateway wrote lines that are not JSON (a traceback?):\n" + "\n".join(not_json[:40])
    rows = [json.loads(x) for x in lines]
    loud_ones = [r for r in rows if r["level"] not in ("debug", "info") or "exc" in r]
    assert not loud_ones, loud_ones
    done = completed()
    ours = [r for r in rows if r["msg"] == "request completed" and r.get("client_request_id") in socks]
    assert len(ours) == len(socks), ours
    for client_id, row in done.items():
        assert (row["status"], row["http_status"], row["key_name"]) == ("cancelled", 499, "admin"), row
        left = [r for r in rows if r["msg"] == "client disconnected" and r["request_id"] == row["request_id"]]
        assert len(left) == 1, (client_id, left)
        assert left[0]["level"] == "info" and left[0]["model"] == PACED
    assert up.key not in gateway.read_text()
