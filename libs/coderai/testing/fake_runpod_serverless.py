"""RunPod serverless endpoints, faked beside the fake GraphQL API (`fake_runpod` serves them at `/v2/...`).

Built from RunPod's published docs:

- Endpoint operations (https://docs.runpod.io/serverless/endpoints/operation-reference and
  https://docs.runpod.io/serverless/endpoints/send-requests): `POST /v2/<id>/run` queues a job and answers
  `{"id", "status": "IN_QUEUE"}`; `POST /v2/<id>/runsync` waits for it and answers `{"id", "status": "COMPLETED",
  "output", "delayTime", "executionTime", "workerId"}` (times in ms); `GET /v2/<id>/status/<job>` answers the same
  for a job; `GET /v2/<id>/health` answers `{"jobs": {"completed", "failed", "inProgress", "inQueue", "retried"},
  "workers": {"idle", "initializing", "ready", "running", "throttled", "unhealthy"}}`. The API key goes in
  `Authorization` (`Bearer <key>` or the bare key); a wrong one is a 401.
- The vLLM worker's OpenAI route (https://docs.runpod.io/serverless/vllm/openai-compatibility): base URL
  `https://api.runpod.ai/v2/<id>/openai/v1` with the RunPod key as the API key: `/chat/completions`,
  `/completions`, `/models`, whole or streamed. `/runsync` and `/run` take `{"input": {"openai_route":
  "/v1/chat/completions", "openai_input": {...}}}` to reach the same routes.
- Billing (https://docs.runpod.io/serverless/pricing): a flex worker is billed from the signal that wakes it to its
  full stop, by the second, a partial second rounded up; it stays up for the endpoint's idle timeout after its last
  job (billed too), then scales to zero. Active (always-on) workers are not modelled.

A worker is a real process: `python -m coderai.testing.fake_openai 0` (an OpenAI-compatible server), started on the
first request when none runs (the cold start) and stopped `idle_timeout_s` after its last job. One worker per
endpoint (`workersMax` 1): concurrent jobs share it. `misbehave(id, "huge" | "malformed")` makes the OpenAI route
answer 64 MB, or a 200 that is not an OpenAI answer, for the attack tests.
"""

from __future__ import annotations

import http.client
import json
import math
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from urllib.parse import SplitResult

from coderai.runtime.embedded import die_with_parent
from coderai.testing.fake_runpod_launch import kill_process

HUGE_BYTES = 64 << 20


@dataclass
class FakeEndpoint:
    """One serverless endpoint. `intervals`: its worker's [start, stop) spans (stop None: running)."""

    id: str
    usd_per_s: float
    idle_timeout_s: float
    process: subprocess.Popen | None = None
    port: int = 0
    last_done: float = 0.0
    in_progress: int = 0
    completed: int = 0
    failed: int = 0
    misbehave: str = ""
    openai_calls: int = 0
    intervals: list[list[float | None]] = field(default_factory=list)
    jobs: dict[str, dict] = field(default_factory=dict)


class FakeServerless:
    """The endpoints of one fake RunPod account (`api_key`); `handle` serves a `/v2/...` request."""

    def __init__(self, api_key: str, now: Callable[[], float] = time.time) -> None:
        self.api_key = api_key
        self.now = now
        self.endpoints: dict[str, FakeEndpoint] = {}
        self.keys_seen: list[str] = []  # every Authorization header's key, right or wrong
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._starts: list[str] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-runpod-serverless", daemon=True)
        self._thread.start()

    def add_endpoint(self, usd_per_s: float = 0.00019, idle_timeout_s: float = 5.0, id: str = "") -> FakeEndpoint:
        """A new endpoint (no worker yet); `usd_per_s` is its flex worker's price (RunPod's L4/A5000/3090 flex price
        by default)."""
        ep = FakeEndpoint(id or secrets.token_hex(7), usd_per_s, idle_timeout_s)
        with self._lock:
            self.endpoints[ep.id] = ep
        return ep

    def misbehave(self, endpoint_id: str, how: str) -> None:
        """The endpoint's OpenAI route answers `huge` (64 MB), `malformed` (a 200 that is no OpenAI answer) or, with
        "", as its worker does."""
        with self._lock:
            self.endpoints[endpoint_id].misbehave = how

    def billed_seconds(self, endpoint_id: str) -> int:
        """Worker seconds billed so far: each span from start to stop (or now), rounded up to the second."""
        with self._lock:
            ep = self.endpoints[endpoint_id]
            return sum(math.ceil((b if b is not None else self.now()) - (a or 0.0)) for a, b in ep.intervals)

    def billed_usd(self, endpoint_id: str) -> float:
        return self.billed_seconds(endpoint_id) * self.endpoints[endpoint_id].usd_per_s

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=10)
        with self._lock:
            eps = list(self.endpoints.values())
        for ep in eps:
            self._stop(ep)

    # --- workers --------------------------------------------------------------------------------------------

    def _worker(self, ep: FakeEndpoint) -> int:
        """The port of the endpoint's running worker, starting one (a cold start) when none runs. Workers are
        started by the fake's long-lived thread: PDEATHSIG fires when the thread that forked dies, and a request's
        thread ends with its request."""
        with self._wake:
            while not (ep.process is not None and ep.process.poll() is None):
                if self._closed.is_set():
                    raise RuntimeError("the fake is closed")
                if ep.id not in self._starts:
                    self._starts.append(ep.id)
                    self._wake.notify_all()
                self._wake.wait(0.1)
            return ep.port

    def _start(self, ep: FakeEndpoint) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "coderai.testing.fake_openai", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()  # "fake OpenAI server on port N"
        with self._wake:
            ep.intervals.append([self.now(), None])
            ep.process, ep.port = proc, int(line.rsplit(" ", 1)[-1])
            self._starts.remove(ep.id)
            self._wake.notify_all()

    def _stop(self, ep: FakeEndpoint) -> None:
        with self._lock:
            proc, ep.process = ep.process, None
            if ep.intervals and ep.intervals[-1][1] is None:
                ep.intervals[-1][1] = self.now()
        kill_process(proc)

    def _loop(self) -> None:
        """Start the workers asked for; scale to zero: a worker idle for its endpoint's idle timeout is stopped."""
        while not self._closed.is_set():
            with self._wake:
                self._wake.wait(0.1)
                starts = [self.endpoints[i] for i in self._starts]  # each leaves the list once it runs
                idle = [
                    ep
                    for ep in self.endpoints.values()
                    if ep.process is not None and not ep.in_progress and self.now() - ep.last_done > ep.idle_timeout_s
                ]
            for ep in starts:
                self._start(ep)
            for ep in idle:
                self._stop(ep)

    # --- HTTP -----------------------------------------------------------------------------------------------

    def handle(self, req: BaseHTTPRequestHandler, method: str, url: SplitResult, body: bytes) -> None:
        """Answer one request under `/v2/`."""
        auth = req.headers.get("Authorization", "")
        key = auth[7:] if auth.startswith("Bearer ") else auth
        with self._lock:
            self.keys_seen.append(key)
        parts = url.path.split("/")  # "", "v2", id, op, ...
        ep = self.endpoints.get(parts[2]) if len(parts) > 3 else None
        if key != self.api_key:
            return _json(req, 401, {"error": "Unauthorized"})
        if ep is None:
            return _json(req, 404, {"error": "endpoint not found"})
        op, rest = parts[3], "/".join(parts[4:])
        if method == "GET" and op == "health":
            return _json(req, 200, self._health(ep))
        if op == "openai" and rest.startswith("v1/"):
            return self._openai(req, ep, method, "/" + rest, body)
        if method == "POST" and op in ("run", "runsync"):
            return self._run(req, ep, op, body)
        if method == "GET" and op == "status" and rest in ep.jobs:
            return _json(req, 200, ep.jobs[rest])
        return _json(req, 404, {"error": f"no route {method} {url.path}"})

    def _health(self, ep: FakeEndpoint) -> dict:
        with self._lock:
            up = ep.process is not None and ep.process.poll() is None
            queued = sum(1 for j in ep.jobs.values() if j["status"] == "IN_QUEUE")
            return {
                "jobs": {
                    "completed": ep.completed,
                    "failed": ep.failed,
                    "inProgress": ep.in_progress,
                    "inQueue": queued,
                    "retried": 0,
                },
                "workers": {
                    "idle": int(up and not ep.in_progress),
                    "initializing": 0,
                    "ready": int(up),
                    "running": int(up and ep.in_progress > 0),
                    "throttled": 0,
                    "unhealthy": 0,
                },
            }

    def _begin(self, ep: FakeEndpoint) -> int:
        with self._lock:
            ep.in_progress += 1
        return self._worker(ep)

    def _end(self, ep: FakeEndpoint, ok: bool) -> None:
        with self._lock:
            ep.in_progress -= 1
            ep.last_done = self.now()
            if ok:
                ep.completed += 1
            else:
                ep.failed += 1

    def _openai(self, req: BaseHTTPRequestHandler, ep: FakeEndpoint, method: str, path: str, body: bytes) -> None:
        with self._lock:
            ep.openai_calls += 1
            how = ep.misbehave
        if how and method == "POST":
            return _misbehave(req, how)
        port, ok = self._begin(ep), False
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request(method, path, body=body if method == "POST" else None, headers=_ct(req))
            resp = conn.getresponse()
            # relayed as it comes (a stream stays a stream), the body delimited by closing the connection
            req.send_response(resp.status)
            req.send_header("Content-Type", resp.getheader("Content-Type") or "application/json")
            req.send_header("Connection", "close")
            req.end_headers()
            while data := resp.read1(65536):
                req.wfile.write(data)
                req.wfile.flush()
            req.close_connection = True
            ok = resp.status < 400
            conn.close()
        finally:
            self._end(ep, ok)

    def _run(self, req: BaseHTTPRequestHandler, ep: FakeEndpoint, op: str, body: bytes) -> None:
        try:
            job_input = json.loads(body)["input"]
            route, payload = job_input["openai_route"], job_input.get("openai_input") or {}
        except (ValueError, KeyError, TypeError):
            return _json(req, 400, {"error": 'the body must be {"input": {"openai_route": ..., ...}}'})
        job = {"id": ("sync-" if op == "runsync" else "") + secrets.token_hex(8), "status": "IN_QUEUE"}
        with self._lock:
            ep.jobs[job["id"]] = job
        if op == "run":
            threading.Thread(target=self._job, args=(ep, job, route, payload), daemon=True).start()
            return _json(req, 200, dict(job))
        self._job(ep, job, route, payload)
        return _json(req, 200, job)

    def _job(self, ep: FakeEndpoint, job: dict, route: str, payload: dict) -> None:
        queued = self.now()
        port = self._begin(ep)
        started, ok = self.now(), False
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", route, body=json.dumps({**payload, "stream": False}).encode())
            resp = conn.getresponse()
            out, ok = json.loads(resp.read()), resp.status < 400
            conn.close()
        except (OSError, ValueError) as exc:
            out = {"error": str(exc)}
        finally:
            self._end(ep, ok)
        job.update(
            status="COMPLETED" if ok else "FAILED",
            output=[out] if ok else None,
            error=None if ok else json.dumps(out),
            delayTime=round((started - queued) * 1000),
            executionTime=round((self.now() - started) * 1000),
            workerId=f"{ep.id}-worker",
        )


def _ct(req: BaseHTTPRequestHandler) -> dict[str, str]:
    return {"Content-Type": req.headers.get("Content-Type") or "application/json"}


def _json(req: BaseHTTPRequestHandler, status: int, body: object) -> None:
    data = json.dumps(body).encode()
    req.send_response(status)
    req.send_header("Content-Type", "application/json")
    req.send_header("Content-Length", str(len(data)))
    req.end_headers()
    req.wfile.write(data)


def _misbehave(req: BaseHTTPRequestHandler, how: str) -> None:
    if how == "malformed":
        data = b'{"id": "x", "choices": "not a list", "usage": 7'
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)
        return
    req.send_response(200)  # huge: one JSON string that never ends, until the reader gives up
    req.send_header("Content-Type", "application/json")
    req.send_header("Connection", "close")
    req.end_headers()
    req.close_connection = True
    block = b"x" * 65536
    try:
        req.wfile.write(b'{"id": "x", "choices": [{"message": {"content": "')
        for _ in range(HUGE_BYTES // len(block)):
            req.wfile.write(block)
    except (BrokenPipeError, ConnectionResetError):
        pass
