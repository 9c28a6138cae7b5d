"""A local fake of RunPod's GraphQL API (the one paid outside service tests may fake), served over HTTP.

It answers the operations the `runpod` 1.12 SDK sends (string-built, so every field it selects is in the schema,
`fake_runpod_schema`) and the same operations sent with proper GraphQL variables (`coderai.pod_broker.runpod_api`).
A pod is a record that is billed by the second from creation (boot included) to termination, and, after `boot_delay_s`, a real
process started by the `launch(env)` callable the test gives (e.g. an engine worker). What is simplified:

- A stopped pod bills 0 (RunPod bills its volume storage while stopped; we do not model storage).
- A crashed pod (`crash()`, or its process exiting) keeps `desiredStatus` RUNNING with a null runtime, and keeps
  billing until stopped or terminated: `desiredStatus` is what the user (or RunPod) wants, and a dead container does
  not change it (RunPod restarts it; the fake does not).
- A spot pod can be preempted (`preempt()`), as RunPod takes the GPU back: stopped (`EXITED`, GPU billing ends), its
  process SIGTERMed, then SIGKILLed after the warning.
- `outage()` answers every call with a server error until it is lifted: RunPod's API down.
- A terminated pod vanishes from `pod` and `myself.pods`, as on RunPod; the fake keeps it for billing.
- Spot pods are charged the type's spot price; a bid below it is refused.
- A wrong API key gets HTTP 401 with a GraphQL error body `Unauthorized`.

Pods are launched from one long-lived thread of the fake: a `die_with_parent()` preexec_fn (PDEATHSIG fires when
the *thread* that forked dies) then keeps a pod alive exactly as long as the fake, and `close()` kills the rest.
"""

from __future__ import annotations

import heapq
import json
import logging
import secrets
import string
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable, Iterable, Mapping
from urllib.parse import parse_qs, urlsplit

from graphql import GraphQLError, graphql_sync

from coderai.testing.fake_runpod_launch import Launch, kill_process
from coderai.testing.fake_runpod_launch import python_launcher as python_launcher  # importable from here too
from coderai.testing.fake_runpod_launch import worker_pods as worker_pods
from coderai.testing.fake_runpod_schema import SCHEMA
from coderai.testing.fake_runpod_serverless import FakeServerless

NO_CAPACITY_MESSAGE = (
    "There are no longer any instances available with the requested specifications. Please refresh and try again."
)
RESUME_NO_CAPACITY_MESSAGE = "There are not enough free GPUs on the host machine to start this pod."
_ECHOED = ("containerDiskInGb", "volumeInGb", "volumeMountPath", "ports", "dockerArgs")
log = logging.getLogger("coderai.testing.fake_runpod")


@dataclass
class FakeGpuType:
    """A card on offer: prices are per GPU-hour; `capacity` is how many more pods of it can be created."""

    id: str
    display_name: str
    memory_gb: int
    price_hr: float
    spot_price_hr: float
    capacity: int = 10
    max_gpu_count: int = 8


DEFAULT_GPU_TYPES = (
    FakeGpuType("NVIDIA GeForce RTX 4090", "RTX 4090", 24, 0.69, 0.35),
    FakeGpuType("NVIDIA RTX A6000", "RTX A6000", 48, 0.79, 0.39),
    FakeGpuType("NVIDIA A100 80GB PCIe", "A100 PCIe", 80, 1.64, 0.82),
    FakeGpuType("NVIDIA H100 80GB HBM3", "H100 SXM", 80, 2.99, 1.49),
)


@dataclass
class FakePod:
    """One rented pod. `intervals` are the billed [start, end) spans on the fake's clock (end None: still open)."""

    id: str
    name: str
    image: str
    env: dict[str, str]
    gpu_type_id: str
    gpu_count: int
    rate_hr: float
    spot: bool
    created_at: float
    status: str = "RUNNING"
    booted_at: float | None = None
    terminated_at: float | None = None
    process: subprocess.Popen | None = None
    spec: dict = field(default_factory=dict)
    intervals: list[list[float | None]] = field(default_factory=list)


class FakeRunPod:
    """RunPod's GraphQL API on http://127.0.0.1:<random port>/graphql; use as a context manager or start()/close()."""

    def __init__(
        self,
        *,
        api_key: str = "fake-runpod-key",
        gpu_types: Iterable[FakeGpuType] = DEFAULT_GPU_TYPES,
        launch: Launch | None = None,
        boot_delay_s: float = 0.0,
        now: Callable[[], float] = time.time,
        host: str = "127.0.0.1",
    ):
        self.api_key = api_key
        self.host = host  # another address of this machine's: one a test's network namespaces reach
        self.gpu_types = {g.id: FakeGpuType(**vars(g)) for g in gpu_types}
        self.launch = launch
        self.boot_delay_s = boot_delay_s
        self.now = now
        self.request_count = 0
        self._pods: dict[str, FakePod] = {}
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._boots: list[tuple[float, str]] = []
        self._failures: list[int] = []
        self._outage: int | None = None
        self._never_prefixes: list[str] = []
        self._never_count = 0
        self._closed = False
        self._server: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        # serverless endpoints (`/v2/<id>/...`, fake_runpod_serverless), on the same port: point the broker's
        # runpod_serverless_base at `base_url`
        self.serverless = FakeServerless(api_key, now)

    def start(self) -> FakeRunPod:
        """Bind a random port on `host` and serve, and start the thread that boots pods."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                fake._handle(self)

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                if url.path.startswith("/v2/"):
                    fake.serverless.handle(self, "GET", url, b"")
                else:
                    fake._reply(self, 404, {"errors": [{"message": "Not Found"}]})

            def log_message(self, *_args) -> None:
                pass

        server = self._server = ThreadingHTTPServer((self.host, 0), Handler)
        server.daemon_threads = True
        serve = lambda: server.serve_forever(poll_interval=0.02)  # shutdown() waits one poll
        for name, target in (("http", serve), ("boot", self._boot_loop)):
            t = threading.Thread(target=target, name=f"fake-runpod-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    @property
    def base_url(self) -> str:
        """What RUNPOD_API_BASE_URL (or the client's base_url) should be; the API is at `{base_url}/graphql`."""
        if self._server is None:
            raise RuntimeError("the fake RunPod API is not started")
        return f"http://{self.host}:{self._server.server_address[1]}"

    def close(self) -> None:
        """Stop serving and kill every pod's process; billing stops as if each pod were terminated now."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            pods = list(self._pods.values())
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for t in self._threads:
            t.join(timeout=10)
        for pod in pods:
            if pod.terminated_at is None:
                self._halt(pod.id, "TERMINATED")
        self.serverless.close()

    def __enter__(self) -> FakeRunPod:
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.close()

    def fail_next(self, n: int, status: int = 500) -> None:
        """Answer the next `n` HTTP calls with `status` (500: server error, 429: rate limited) before any work."""
        with self._lock:
            self._failures.extend([status] * n)

    def outage(self, status: int | None = 503) -> None:
        """Answer every HTTP call with `status` from now on, as RunPod's API does while it is down; None: answer
        again."""
        with self._lock:
            self._outage = status

    def never_boot(self, prefix: str | None = None, count: int = 0) -> None:
        """Pods named with `prefix`, and the next `count` pods created, never start (no process, runtime null)."""
        with self._lock:
            if prefix is not None:
                self._never_prefixes.append(prefix)
            self._never_count += count

    def set_capacity(self, gpu_type_id: str, capacity: int) -> None:
        """How many more pods of this type can be created (0: the create mutations answer no-capacity)."""
        with self._lock:
            self.gpu_types[gpu_type_id].capacity = capacity

    def crash(self, pod_id: str) -> None:
        """Kill a running pod's process as a crash would: it stays desired RUNNING, without a runtime, and keeps
        billing."""
        self._halt(pod_id, "RUNNING", keep_billing=True)

    def preempt(self, pod_id: str, warning_s: float = 5.0) -> None:
        """Interrupt a spot pod as RunPod does when it wants the GPU back, and return once its process is gone.

        RunPod's Pods pricing page ("Spot instances", docs.runpod.io/pods/pricing, runpod/docs pods/pricing.mdx): a
        spot instance "can be stopped if a higher bid is placed or an on-demand deployment requires the resources",
        "with only a 5-second warning (SIGTERM signal, followed by SIGKILL)", and "your volume disk is retained".
        So the pod is stopped, not deleted: `desiredStatus` EXITED, a null runtime, still listed until terminated,
        and its GPU billing ends now (a stopped pod bills only its volume, which the fake does not model).
        On-demand pods are never interrupted: preempting one is a test's mistake."""
        with self._lock:
            if not self._pods[pod_id].spot:
                raise ValueError(f"pod {pod_id} is on demand: RunPod interrupts spot pods only")
        self._halt(pod_id, "EXITED", grace_s=warning_s)

    def pod(self, pod_id: str) -> FakePod:
        """The fake's own record of a pod, terminated ones included."""
        with self._lock:
            return self._refresh(self._pods[pod_id])

    def pods(self) -> list[FakePod]:
        """Every pod ever created here, in creation order."""
        with self._lock:
            return [self._refresh(p) for p in self._pods.values()]

    def billed_seconds(self, pod_id: str) -> float:
        """Seconds billed so far: creation (boot included) to stop or termination, or to now while running."""
        with self._lock:
            total = 0.0
            for start, end in self._pods[pod_id].intervals:
                assert start is not None  # only an interval's end is ever None (open)
                total += (end if end is not None else self.now()) - start
            return total

    def billed_usd(self, pod_id: str) -> float:
        """The pod's spend: rate_hr / 3600 x billed seconds."""
        return self._pods[pod_id].rate_hr / 3600 * self.billed_seconds(pod_id)

    def total_billed_usd(self) -> float:
        """Spend over every pod ever created here."""
        return sum(self.billed_usd(pid) for pid in list(self._pods))

    def wait_booted(self, pod_id: str, timeout_s: float = 30.0) -> FakePod:
        """Poll until the pod has booted (its launch was called), failing after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pod = self.pod(pod_id)
            if pod.booted_at is not None:
                return pod
            time.sleep(0.01)
        raise TimeoutError(f"pod {pod_id} did not boot within {timeout_s}s")

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        url = urlsplit(req.path)
        body = req.rfile.read(int(req.headers.get("Content-Length") or 0))
        if url.path.startswith("/v2/"):
            return self.serverless.handle(req, "POST", url, body)
        with self._lock:
            self.request_count += 1
            injected = self._failures.pop(0) if self._failures else self._outage
        if url.path != "/graphql":
            return self._reply(req, 404, {"errors": [{"message": "Not Found"}]})
        if injected is not None:
            return self._reply(
                req,
                injected,
                {"errors": [{"message": f"injected HTTP {injected}"}]},
                {"Retry-After": "1"} if injected == 429 else None,
            )
        auth = req.headers.get("Authorization", "")
        key = auth[7:] if auth.startswith("Bearer ") else (parse_qs(url.query).get("api_key") or [""])[0]
        if key != self.api_key:
            return self._reply(req, 401, {"errors": [{"message": "Unauthorized"}]})
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            return self._reply(req, 400, {"errors": [{"message": "POST body must be a JSON object"}]})
        result = graphql_sync(
            SCHEMA,
            payload.get("query") or "",
            root_value=self._root,
            variable_values=payload.get("variables"),
            operation_name=payload.get("operationName"),
        )
        self._reply(req, 400 if result.data is None and result.errors else 200, result.formatted)

    @staticmethod
    def _reply(
        req: BaseHTTPRequestHandler, status: int, body: Mapping[str, object], headers: dict | None = None
    ) -> None:
        data = json.dumps(body).encode()
        req.send_response(status)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            req.send_header(k, v)
        req.end_headers()
        req.wfile.write(data)

    @property
    def _root(self) -> dict:
        return {
            "gpuTypes": self._q_gpu_types,
            "pod": self._q_pod,
            "myself": self._q_myself,
            "podFindAndDeployOnDemand": lambda _i, input: self._create(input, None),
            "podRentInterruptable": lambda _i, input: self._create(input, input["bidPerGpu"]),
            "podStop": self._m_stop,
            "podResume": self._m_resume,
            "podTerminate": self._m_terminate,
        }

    def _q_gpu_types(self, _info, input=None) -> list[dict]:
        ids = None if not input else ([input["id"]] if input.get("id") else input.get("ids"))
        with self._lock:
            return [self._gpu_view(g) for g in self.gpu_types.values() if ids is None or g.id in ids]

    def _gpu_view(self, g: FakeGpuType) -> dict:
        stock = None if g.capacity <= 0 else "Low" if g.capacity < 3 else "Medium" if g.capacity < 10 else "High"

        def lowest(_info, input=None):  # prices stay per GPU-hour whatever gpuCount asks
            return {
                "minimumBidPrice": g.spot_price_hr,
                "uninterruptablePrice": g.price_hr,
                "stockStatus": stock,
                "gpuTypeId": g.id,
                "availableGpuCounts": list(range(1, g.max_gpu_count + 1)) if g.capacity > 0 else [],
            }

        return {
            "id": g.id,
            "displayName": g.display_name,
            "memoryInGb": g.memory_gb,
            "maxGpuCount": g.max_gpu_count,
            "manufacturer": "Nvidia",
            "cudaCores": 0,
            "secureCloud": True,
            "communityCloud": True,
            "securePrice": g.price_hr,
            "communityPrice": g.price_hr,
            "secureSpotPrice": g.spot_price_hr,
            "communitySpotPrice": g.spot_price_hr,
            "lowestPrice": lowest,
        }

    def _q_pod(self, _info, input) -> dict | None:
        with self._lock:
            pod = self._pods.get(input["podId"])
            return None if pod is None or pod.terminated_at is not None else self._pod_view(pod)

    def _q_myself(self, _info) -> dict:
        with self._lock:
            return {
                "id": "fake-user",
                "pods": [self._pod_view(p) for p in self._pods.values() if p.terminated_at is None],
            }

    def _pod_view(self, pod: FakePod) -> dict:
        self._refresh(pod)
        up = None if pod.booted_at is None else int(self.now() - pod.booted_at)
        return {
            "id": pod.id,
            "name": pod.name,
            "desiredStatus": pod.status,
            "imageName": pod.image,
            "env": [f"{k}={v}" for k, v in pod.env.items()],
            "machineId": f"m-{pod.id}",
            "costPerHr": pod.rate_hr,
            "gpuCount": pod.gpu_count,
            "podType": "INTERRUPTABLE" if pod.spot else "RESERVED",
            "uptimeSeconds": up or 0,
            "runtime": None
            if up is None
            else {
                "uptimeInSeconds": up,
                "ports": [],
                "container": {"cpuPercent": 0, "memoryPercent": 0},
                "gpus": [
                    {"id": f"GPU-{pod.id}-{i}", "gpuUtilPercent": 0, "memoryUtilPercent": 0}
                    for i in range(pod.gpu_count)
                ],
            },
            "machine": {
                "podHostId": f"{pod.id}-fake",
                "gpuTypeId": pod.gpu_type_id,
                "gpuDisplayName": self.gpu_types[pod.gpu_type_id].display_name,
            },
            **{k: pod.spec.get(k) for k in _ECHOED},
        }

    def _create(self, spec: dict, bid: float | None) -> dict:
        with self._lock:
            gpu = self.gpu_types.get(spec.get("gpuTypeId") or "")
            count = spec.get("gpuCount") or 1
            if gpu is None:
                raise GraphQLError(f"Invalid GPU type: {spec.get('gpuTypeId')!r}")
            if not spec.get("name") or not spec.get("imageName"):
                raise GraphQLError("name and imageName are required")
            if not 1 <= count <= gpu.max_gpu_count:
                raise GraphQLError(f"gpuCount must be between 1 and {gpu.max_gpu_count}")
            if bid is not None and bid < gpu.spot_price_hr:
                raise GraphQLError(f"Your bid of {bid} is below the current spot price of {gpu.spot_price_hr}.")
            if gpu.capacity <= 0:
                raise GraphQLError(NO_CAPACITY_MESSAGE)
            gpu.capacity -= 1
            pod_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(14))
            now = self.now()
            pod = FakePod(
                id=pod_id,
                name=spec["name"],
                image=spec["imageName"],
                gpu_type_id=gpu.id,
                env={e["key"]: e["value"] for e in spec.get("env") or []},
                gpu_count=count,
                rate_hr=(gpu.spot_price_hr if bid is not None else gpu.price_hr) * count,
                spot=bid is not None,
                created_at=now,
                intervals=[[now, None]],
                spec=spec,
            )
            self._pods[pod_id] = pod
            self._schedule_boot(pod)
            return self._pod_view(pod)

    def _schedule_boot(self, pod: FakePod) -> None:
        if any(pod.name.startswith(p) for p in self._never_prefixes):
            return
        if self._never_count > 0:
            self._never_count -= 1
            return
        heapq.heappush(self._boots, (time.monotonic() + self.boot_delay_s, pod.id))
        self._wake.notify_all()

    def _boot_loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (not self._boots or self._boots[0][0] > time.monotonic()):
                    self._wake.wait(None if not self._boots else self._boots[0][0] - time.monotonic())
                if self._closed:
                    return
                pod = self._pods[heapq.heappop(self._boots)[1]]
                if pod.status != "RUNNING" or pod.booted_at is not None:
                    continue
                env = {"RUNPOD_POD_ID": pod.id, "RUNPOD_GPU_COUNT": str(pod.gpu_count), **pod.env}
            try:
                proc = self.launch(env) if self.launch is not None else None
            except Exception:  # like a container that cannot start; other pods still boot
                log.exception("fake RunPod: launching pod %s failed", pod.id)
                with self._lock:
                    pod.status = "EXITED" if pod.status == "RUNNING" else pod.status
                continue
            with self._lock:
                if pod.status == "RUNNING" and not self._closed:
                    pod.process, pod.booted_at, proc = proc, self.now(), None
            kill_process(proc)  # the pod was stopped or terminated while its process started

    def _refresh(self, pod: FakePod) -> FakePod:
        if pod.process is not None and pod.process.poll() is not None:  # its container died: no runtime
            pod.process, pod.booted_at = None, None
        return pod

    def _end_billing(self, pod: FakePod) -> None:
        if pod.intervals and pod.intervals[-1][1] is None:
            pod.intervals[-1][1] = self.now()
            self.gpu_types[pod.gpu_type_id].capacity += 1

    def _live(self, pod_id: str) -> str:
        pod = self._pods.get(pod_id)
        if pod is None or pod.terminated_at is not None:
            raise GraphQLError(f"Pod {pod_id!r} not found")
        return pod_id

    def _halt(self, pod_id: str, status: str, keep_billing: bool = False, grace_s: float = 5.0) -> FakePod:
        with self._lock:
            pod = self._pods[pod_id]
            proc, pod.process, pod.booted_at, pod.status = pod.process, None, None, status
            if not keep_billing:
                self._end_billing(pod)
            if status == "TERMINATED":
                pod.terminated_at = self.now()
        kill_process(proc, grace_s)
        return pod

    def _m_stop(self, _info, input) -> dict:
        pod = self._halt(self._live(input["podId"]), "EXITED")
        with self._lock:
            return self._pod_view(pod)

    def _m_resume(self, _info, input) -> dict:
        with self._lock:
            pod = self._pods[self._live(input["podId"])]
            if pod.status != "RUNNING":
                gpu = self.gpu_types[pod.gpu_type_id]
                if pod.intervals[-1][1] is not None:
                    if gpu.capacity <= 0:
                        raise GraphQLError(RESUME_NO_CAPACITY_MESSAGE)
                    gpu.capacity -= 1
                    pod.intervals.append([self.now(), None])
                pod.status = "RUNNING"
                self._schedule_boot(pod)
            return self._pod_view(pod)

    def _m_terminate(self, _info, input) -> None:
        self._halt(self._live(input["podId"]), "TERMINATED")
