"""Cold start of a burst: from the request that makes the broker rent a pod to that request's first token, split
into the phases a user waits through, for a small model and a ~1 GB one.

Everything is local and real except RunPod itself: a secured nats-server (as `coderai up` runs it), Redis,
router, scheduler, metrics, pod-broker and gateway. The RunPod API is `coderai.testing.fake_runpod`, whose pods
are real engine-worker processes started the moment a pod is created (there is no image to pull), and the
weights come from `coderai.testing.fake_hub`, a local server speaking the Hugging Face Hub's download API, by
each model's `source = "hf://..."`. The stack has no worker of its own, so the first request for a model finds
no node that holds it and the broker rents a pod for it (`burst = "when_no_fit"`). Each cold start is a model of
its own (`small-1`, `small-2`, ...), so every round rents a fresh pod that fetches the weights again. Then the
same with a network volume (`pod.volume`; a folder every pod of the fake shares, where RunPod would mount the
volume): the first pod fills it, the next ones find the weights there, recorded as verified, and skip the
download (`small-vol-1`, `small-vol-2`, ...). After its round, each pod is left idle until the broker reaps it
(`--idle`, 8 s), so every cold start begins with no pod running.

Phases, each timestamped by the process that saw it (none inferred from a sleep):

  rent         this client sent the request -> the fake RunPod API created the pod (its record's created_at:
               gateway, router, scheduler's escalation, broker's offer, pod user and create_pod call)
  boot         -> the pod's process was started (the fake's launch returned)
  join         -> the pod's first heartbeat (its `ts`: the worker is up and on the bus)
  fetch        `ModelFetch` resolving -> done (Hub metadata, download, sha256 check)
  load         -> `ModelLoaded` (llama.cpp loaded the GGUF)
  first token  -> the first content chunk reached this client (router saw the engine, gateway picked it,
               prompt and first token computed, streamed back)

`other` is what the phases leave out of the total (the worker's setup between its first heartbeat and the
fetch's first event). Baselines, measured in the same run: the same request once the pod is warm (time to first
token, median of `--warm` requests, each prompt new to the engine), and a plain HTTP GET of the same file from
the same server by a process of its own (httpx, written to disk and kept, then hashed with sha256 as the pull
does), right before or after the cold start, alternately, against the fetch phase.

Models: `small` is the project's tiny GGUF recipe (`coderai.tiny_models.llm`, 64 dims, 2 layers); `1gb` is the
same recipe at 2048 dims, 10 layers, 16 heads, f16: ~1.04 GB of tensors, built once and cached (model cache).

Usage:
  python bench/burst.py                        # both models, 5 + 3 on a volume each (4-7 minutes on 2 cores)
  python bench/burst.py --models small --rounds 1 --volume-rounds 0
  python bench/burst.py --smoke                # small model, 1 + 2 on a volume: the bench runs end to end
  python bench/burst.py --json out.json        # the measurements as JSON too; --keep keeps every log
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from coderai.contracts import Heartbeat, ModelFetch, ModelLoaded, PodEvent
from coderai.contracts.subjects import EVT_MODEL_FETCH, EVT_MODEL_LOADED, EVT_POD, HEARTBEAT
from coderai.runtime.bus import Bus
from coderai.runtime.embedded import NatsServer, RedisServer
from coderai.testing.stack import Stack, write_models_file

SHAPES = {"small": {"dim": 64, "layers": 2, "heads": 4}, "1gb": {"dim": 2048, "layers": 10, "heads": 16, "ff": 5632}}
RECIPE = "1"  # bump when SHAPES or the builder change: the cached GGUFs are rebuilt
PHASES = ("rent", "boot", "join", "fetch", "load", "first_token")
FILE = "model.gguf"
VOLUME = "bench-volume"  # the network volume id the `*-vol-*` models name


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="small,1gb", help=f"which of {sorted(SHAPES)} (default small,1gb)")
    ap.add_argument("--rounds", type=int, default=5, help="cold starts per model, each on a fresh pod (default 5)")
    ap.add_argument(
        "--volume-rounds",
        type=int,
        default=3,
        help="cold starts per model on a shared network volume: the first fills it, the rest find the "
        "weights there (default 3; 0: none)",
    )
    ap.add_argument("--warm", type=int, default=5, help="streamed requests to the warm pod, per round (default 5)")
    ap.add_argument(
        "--idle",
        type=float,
        default=8.0,
        help="each pod's idle timeout: it is reaped after its round, before the next (default 8 s)",
    )
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one cold start may take (default 600)")
    ap.add_argument("--json", help="also write the measurements here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (every service's and pod's log)")
    ap.add_argument(
        "--smoke", action="store_true", help="small model: one cold start and two on a volume, two warm requests each"
    )
    a = ap.parse_args(argv)
    if a.smoke:
        a.models, a.rounds, a.volume_rounds, a.warm, a.idle = "small", 1, 2, 2, 2.0
    a.models = [m.strip() for m in a.models.split(",") if m.strip()]
    if unknown := set(a.models) - set(SHAPES):
        ap.error(f"unknown models {sorted(unknown)}; choose from {sorted(SHAPES)}")
    if a.rounds < 1 or a.warm < 1 or a.volume_rounds < 0:
        ap.error("--rounds and --warm take at least 1, --volume-rounds at least 0")
    return a


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def build_model(kind: str) -> Path:
    """The GGUF of `kind`, built once (offline, random weights, the project's tokenizer) and kept in the model
    cache (coderai.tiny_models.cache)."""
    from coderai.tiny_models.cache import cached_build
    from coderai.tiny_models.llm import build_tiny_gguf

    def build(out: Path) -> None:
        t = time.monotonic()
        shape = build_tiny_gguf(out / FILE, name=f"burst-{kind}", **SHAPES[kind])
        log(
            f"built the {kind} GGUF ({shape['bytes'] / 1e6:.1f} MB, {shape['params'] / 1e6:.1f}M params) "
            f"in {time.monotonic() - t:.0f}s"
        )

    return cached_build(f"burst-{kind}", RECIPE, build) / FILE


@dataclass(frozen=True)
class Planned:
    """One cold start to measure: a model of its own (so a fresh pod), on the shared network volume or not, and
    the row of the report it counts in."""

    kind: str
    model: str
    volume: bool
    group: str

    @property
    def baseline(self) -> bool:
        """Whether the fetch downloads the file (and is compared with a plain download): not when it is on the
        volume already."""
        return self.group == self.kind


def plan(a: argparse.Namespace) -> list[Planned]:
    out = []
    for kind in a.models:
        out += [Planned(kind, f"{kind}-{i}", False, kind) for i in range(1, a.rounds + 1)]
        # the first fills the volume (a cold start like the others); the next find the weights on it
        out += [
            Planned(kind, f"{kind}-vol-{i}", True, kind if i == 1 else f"{kind}, weights on the volume")
            for i in range(1, a.volume_rounds + 1)
        ]
    return out


# --- what the bus and the fake saw ------------------------------------------------------------------------------


@dataclass
class Seen:
    """Every event this run cares about, as it arrives: first heartbeat per node, fetch progress per node, loads
    per node, pods created per model."""

    first_hb: dict[str, float] = field(default_factory=dict)
    fetches: dict[str, list[ModelFetch]] = field(default_factory=dict)
    loaded: dict[str, ModelLoaded] = field(default_factory=dict)
    created: dict[str, PodEvent] = field(default_factory=dict)
    billed: set[str] = field(default_factory=set)  # pods the broker has terminated and billed
    failed: dict[str, str] = field(default_factory=dict)  # model -> why its pod cannot serve it
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def listen(self, bus: Bus) -> None:
        async def on_hb(hb: Heartbeat, _m) -> None:
            self.first_hb.setdefault(hb.node_id, hb.ts)
            for e in hb.engines:
                if e.state == "failed":
                    self.failed.setdefault(e.model, f"{hb.node_id}: engine failed: {e.error}")
            self.changed.set()

        async def on_fetch(evt: ModelFetch, _m) -> None:
            self.fetches.setdefault(evt.node_id, []).append(evt)
            if evt.state == "failed":
                self.failed.setdefault(evt.model, f"{evt.node_id}: fetch failed: {evt.error}")
            self.changed.set()

        async def on_loaded(evt: ModelLoaded, _m) -> None:
            self.loaded.setdefault(evt.node_id, evt)
            self.changed.set()

        async def on_pod(evt: PodEvent, _m) -> None:
            if evt.what == "created":
                self.created.setdefault(evt.model, evt)
            elif evt.what == "billed":
                self.billed.add(evt.name)
            self.changed.set()

        for subject, handler in (
            (HEARTBEAT, on_hb),
            (EVT_MODEL_FETCH, on_fetch),
            (EVT_MODEL_LOADED, on_loaded),
            (EVT_POD, on_pod),
        ):
            await bus.listen(subject, handler, subject_str=subject.wildcard())

    async def until(self, predicate, timeout_s: float, what: str):
        """`predicate()`'s value once it is truthy, woken by each event; TimeoutError naming `what` after
        `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not (got := predicate()):
            self.changed.clear()
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"no {what} within {timeout_s:.0f}s")
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                pass
        return got


def pod_launcher(pod_dir: Path, volume_dir: Path, hub, started: dict[str, float]):
    """The fake's `launch`: a real engine worker per pod (`worker_pods`), pointed at the local Hub, recording
    when its process was started. A network volume (mounted at /workspace on RunPod) is `volume_dir` here, one
    folder every pod shares."""
    from coderai.testing.fake_hub import hub_env
    from coderai.testing.fake_runpod import worker_pods

    inner = worker_pods(pod_dir)

    def launch(env: dict[str, str]):
        name = env.get("CODERAI_NODE_ID") or env["RUNPOD_POD_ID"]
        env = {**env, **hub_env(hub, str(pod_dir / name / "hf"))}
        if "CODERAI_WORKER_WEIGHTS_DIR" in env:
            env["CODERAI_WORKER_WEIGHTS_DIR"] = str(volume_dir / env["CODERAI_WORKER_WEIGHTS_DIR"].lstrip("/"))
        proc = inner(env)
        started[name] = time.time()
        return proc

    return launch


# --- requests ---------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    sent: float
    first: float
    engine: str

    @property
    def ttft_s(self) -> float:
        return self.first - self.sent


def _content(line: str) -> str:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return ""
    choices = json.loads(line[6:]).get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""


async def stream_chat(http: httpx.AsyncClient, model: str, max_tokens: int) -> Answer:
    """One streamed chat, read to its end; when it was sent and when its first content arrived (wall clock, as
    the events' timestamps). Each prompt starts with a word of its own, so a warm engine evaluates it whole
    instead of reusing the last request's cached prefix, as a cold one must."""
    content = f"{uuid.uuid4().hex[:8]}: say hello."
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    first = None
    sent = time.time()
    async with http.stream("POST", "/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        engine = r.headers.get("coderai-engine", "")
        async for line in r.aiter_lines():
            if first is None and _content(line):
                first = time.time()
    if first is None:
        raise RuntimeError(f"{model}: the streamed answer carried no content")
    return Answer(sent, first, engine)


PLAIN_GET = """
import hashlib, sys, time, httpx
url, dest = sys.argv[1:3]
with httpx.Client(timeout=300) as client:  # made before the clock starts, as the pull's session is
    t = time.perf_counter()
    with client.stream("GET", url) as r, open(dest, "wb") as fh:
        r.raise_for_status()
        for chunk in r.iter_bytes(1 << 20):
            fh.write(chunk)
    got = time.perf_counter() - t
with open(dest, "rb") as fh:
    hashlib.file_digest(fh, "sha256")
print(got, time.perf_counter() - t)
"""


def plain_download(url: str, dest: Path) -> tuple[float, float]:
    """GET `url` into `dest` with a plain httpx client in a process of its own (as a pod's worker is: the Hub-like
    server runs in this one); seconds for the download, and for the download plus a sha256 of the file. The file
    is kept, as a pod keeps its weights: deleting a gigabyte, or not, changes how fast the next one is written."""
    r = subprocess.run(
        [sys.executable, "-c", PLAIN_GET, url, str(dest)],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    if r.returncode != 0:
        raise RuntimeError(f"plain download of {url} failed:\n{r.stderr[-2000:]}")
    got, both = (float(x) for x in r.stdout.split())
    return got, both


# --- one cold start ---------------------------------------------------------------------------------------------


@dataclass
class Round:
    """One cold start: its milestones (wall clock) and what they split into, and its baselines."""

    kind: str
    group: str  # the report's row
    model: str
    pod: str
    gpu_type: str
    engine: str
    milestones: dict[str, float]
    phases: dict[str, float]
    total_s: float
    other_s: float
    downloaded: bool  # the pod downloaded (and hashed) the file; False: it found it verified on the volume
    fetch_resolve_s: float
    fetch_download_s: float
    fetch_verify_s: float
    fetch_bytes: int
    fetch_progress: list[tuple[float, int]]  # (seconds since the download began, bytes done) per event
    load_s: float  # the worker's own measure of the engine load (ModelLoaded.load_s, the fetch not included)
    warm_ttft_s: list[float]
    plain_get_s: float
    plain_get_sha_s: float

    @property
    def warm_s(self) -> float:
        return statistics.median(self.warm_ttft_s)


async def first_of(answer, seen: Seen, model: str, fake, timeout_s: float, pod_dir: Path) -> Answer:
    """The cold request's answer; or, as soon as the model's pod says it cannot serve (a failed fetch or engine)
    or its process died, an error saying so, with the end of the pod's log, instead of waiting out the
    gateway's escalation."""

    def broken() -> str:
        if why := seen.failed.get(model):
            return why
        created = seen.created.get(model)
        pod = fake.pod(created.pod_id) if created else None
        proc = pod.process if pod else None
        if proc is not None and proc.poll() is not None:
            return f"{created.name}: its process exited with {proc.returncode}"
        return ""

    task = asyncio.ensure_future(asyncio.wait_for(answer, timeout_s))
    watch = asyncio.ensure_future(seen.until(broken, timeout_s + 5, f"failure of {model}'s pod"))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        why = watch.result()
    finally:
        for t in (task, watch):
            t.cancel()
    created = seen.created.get(model)
    logs = ""
    if created is not None:
        with contextlib.suppress(OSError):
            logs = "\n" + (pod_dir / f"{created.name}.log").read_text()[-3000:]
    raise RuntimeError(f"the cold start of {model} failed: {why}{logs}")


def _first(events: list[ModelFetch], state: str, file: str | None = None) -> ModelFetch | None:
    return next((e for e in events if e.state == state and (file is None or e.file == file)), None)


async def cold_start(
    http: httpx.AsyncClient,
    seen: Seen,
    fake,
    started: dict[str, float],
    hub_url: str,
    repo: str,
    p: Planned,
    root: Path,
    a: argparse.Namespace,
    plain_first: bool,
) -> Round:
    """One cold start of `p`, then its warm requests; the plain download of the same file right before the cold
    start (`plain_first`) or right after the warm requests, alternately, so neither always follows the other's
    gigabyte of writes."""
    model = p.model
    get_s = get_sha_s = 0.0

    async def plain() -> tuple[float, float]:
        return await asyncio.to_thread(
            plain_download, f"{hub_url}/{repo}/resolve/main/{FILE}", root / f"plain-{model}.gguf"
        )

    if p.baseline and plain_first:
        get_s, get_sha_s = await plain()
    cold = await first_of(stream_chat(http, model, a.max_tokens), seen, model, fake, a.timeout, root / "pods")
    created = await seen.until(lambda: seen.created.get(model), 30, f"pod created event for {model}")
    node = created.name
    if cold.engine and not cold.engine.startswith(node):
        raise RuntimeError(f"{model} was answered by {cold.engine}, not by its pod {node}")
    loaded = await seen.until(lambda: seen.loaded.get(node), 30, f"ModelLoaded from {node}")
    events = await seen.until(
        lambda: (ev := seen.fetches.get(node)) and _first(ev, "done") and ev, 30, f"the fetch's done event from {node}"
    )
    if failed := _first(events, "failed"):
        raise RuntimeError(f"{node}: fetch failed: {failed.error}")
    resolving, dl, verifying, done = (
        _first(events, "resolving"),
        _first(events, "downloading", FILE),
        _first(events, "verifying"),
        _first(events, "done"),
    )
    if not (resolving and dl and (verifying or not p.baseline)):
        raise RuntimeError(f"{node}: incomplete fetch events: {[(e.state, e.file) for e in events]}")
    checked = verifying or done  # a file found on the volume, recorded as verified, is neither fetched nor hashed
    pod = fake.pod(created.pod_id)
    m = {
        "request": cold.sent,
        "rented": pod.created_at,
        "booted": started[node],
        "joined": seen.first_hb[node],
        "fetch_start": resolving.ts,
        "fetch_done": done.ts,
        "loaded": loaded.ts,
        "first_token": cold.first,
    }
    phases = {
        "rent": m["rented"] - m["request"],
        "boot": m["booted"] - m["rented"],
        "join": m["joined"] - m["booted"],
        "fetch": m["fetch_done"] - m["fetch_start"],
        "load": m["loaded"] - m["fetch_done"],
        "first_token": m["first_token"] - m["loaded"],
    }
    total = m["first_token"] - m["request"]
    warm = []
    for _ in range(a.warm):
        w = await stream_chat(http, model, a.max_tokens)
        if w.engine and not w.engine.startswith(node):
            raise RuntimeError(f"a warm request for {model} was answered by {w.engine}, not by its pod {node}")
        warm.append(w.ttft_s)
    if p.baseline and not plain_first:
        get_s, get_sha_s = await plain()
    return Round(
        kind=p.kind,
        group=p.group,
        model=model,
        pod=node,
        gpu_type=created.gpu_type,
        engine=cold.engine,
        milestones=m,
        phases=phases,
        total_s=total,
        other_s=total - sum(phases.values()),
        downloaded=verifying is not None,
        fetch_resolve_s=dl.ts - resolving.ts,
        fetch_download_s=checked.ts - dl.ts,
        fetch_verify_s=done.ts - checked.ts,
        fetch_bytes=done.bytes_done,
        fetch_progress=[(round(e.ts - dl.ts, 3), e.bytes_done) for e in events if e.ts >= dl.ts],
        load_s=loaded.load_s,
        warm_ttft_s=warm,
        plain_get_s=get_s,
        plain_get_sha_s=get_sha_s,
    )


async def measure(stack: Stack, fake, hub, started: dict[str, float], root: Path, a: argparse.Namespace) -> list[Round]:
    bus = await Bus.connect(stack.nats.service_url, "bench-burst")
    seen = Seen()
    await seen.listen(bus)
    rounds: list[Round] = []
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=a.timeout + 60) as http:
            for i, p in enumerate(plan(a)):
                r = await cold_start(
                    http, seen, fake, started, hub.url, f"bench/{p.kind}-GGUF", p, root, a, plain_first=i % 2 == 1
                )
                log(
                    f"{r.model}: first token {r.total_s:.2f}s after the request ("
                    + ", ".join(f"{k} {v:.2f}" for k, v in r.phases.items())
                    + f"); warm {r.warm_s:.3f}s; plain GET {r.plain_get_s:.2f}s"
                )
                rounds.append(r)
                # the next cold start begins on an idle cluster again, as a burst does: no pod left running
                await seen.until(lambda pod=r.pod: pod in seen.billed, a.idle + 60, f"{r.pod} to be reaped and billed")
    finally:
        await bus.close()
    return rounds


# --- the run ----------------------------------------------------------------------------------------------------


def models_file(root: Path, files: dict[str, Path], a: argparse.Namespace) -> Path:
    """One model per cold start; none can be placed on this stack's nodes (it has none), every one bursts and
    fetches its weights by `source` (its `path` exists nowhere), some onto one shared network volume."""
    models = []
    for p in plan(a):
        pod = {"burst": "when_no_fit", "idle_timeout_s": a.idle, "budget_usd": 50} | (
            {"volume": VOLUME} if p.volume else {}
        )
        models.append(
            {
                "name": p.model,
                "engine": "llama",
                "path": f"/nowhere/{p.kind}/{FILE}",
                "source": f"hf://bench/{p.kind}-GGUF/{FILE}",
                "params": {"n_ctx": 256, "seed": 1},
                "memory_mb": max(64, files[p.kind].stat().st_size * 3 // 2 >> 20),
                "pod": pod,
            }
        )
    return write_models_file(root / "models.toml", models)


def run(root: Path, a: argparse.Namespace) -> list[Round]:
    from coderai.testing.fake_hub import FakeHub
    from coderai.testing.fake_runpod import FakeRunPod

    files = {kind: build_model(kind) for kind in a.models}
    hub = FakeHub()
    for kind, path in files.items():
        hub.add(f"bench/{kind}-GGUF", {FILE: path.read_bytes()})
        hub.digests(f"bench/{kind}-GGUF", FILE)  # hashed now, as the real Hub has them: not in the first fetch
    started: dict[str, float] = {}
    fake = FakeRunPod(launch=pod_launcher(root / "pods", root / "volume", hub, started)).start()
    nats = NatsServer.secured(root / "nats").start(log_file=root / "logs" / "nats.log")
    redis = RedisServer(root / "redis").start(log_file=root / "logs" / "redis.log")
    deployment = "b" + uuid.uuid4().hex[:6]
    stack = Stack(
        root,
        nats.service_url,
        redis.url,
        {"CODERAI_WORKER_MDNS": "false", "CODERAI_POD_LEDGER_PREFIX": f"coderai:pods:{deployment}"},
    )
    stack.nats = nats
    try:
        t = time.monotonic()
        stack.start_core(models_file(root, files, a))
        stack.start(
            "pod-broker",
            "coderai.pod_broker",
            env={
                "CODERAI_POD_BROKER_RUNPOD_API_KEY": fake.api_key,
                "CODERAI_POD_BROKER_RUNPOD_API_BASE": fake.base_url,
                "CODERAI_POD_BROKER_REDIS_URL": redis.url,
                "CODERAI_POD_BROKER_POD_NATS_URL": nats.url,
                "CODERAI_POD_BROKER_DEPLOYMENT": deployment,
                "CODERAI_POD_BROKER_MAX_HOURLY_USD": "50",
            },
        )
        stack.start_gateway("--no-auth", env={"CODERAI_GATEWAY_ESCALATE_WAIT_S": str(a.timeout)})
        log(f"stack up in {time.monotonic() - t:.0f}s (no worker of its own; pods from the fake RunPod API)")
        return asyncio.run(measure(stack, fake, hub, started, root, a))
    finally:
        stack.stop()
        fake.close()
        hub.close()
        redis.stop()
        nats.stop()


# --- report -----------------------------------------------------------------------------------------------------


def loadavg() -> str:
    """The machine's 1-minute load average: other work on a shared box shows in every phase."""
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(
    rounds: list[Round], files: dict[str, int], a: argparse.Namespace, wall_s: float, load: tuple[str, str]
) -> str:
    of: dict[str, list[Round]] = {}
    for r in rounds:
        of.setdefault(r.group, []).append(r)
    size = {r.group: files[r.kind] for r in rounds}
    out = [
        f"## Burst cold start ({'smoke' if a.smoke else 'full'} run, {wall_s:.0f}s)",
        "",
        f"Machine: {os.cpu_count()} CPUs, load average {load[0]} before the run and {load[1]} after. Fake RunPod "
        "API (pods are local engine-worker processes, no image pull), weights from a local Hub-like server. "
        "Median of the cold starts in each row, each on a fresh pod (n); the volume rows are pods that found the "
        "weights on the network volume an earlier pod filled. Warm: median of "
        f"{a.warm} streamed requests per round to the pod once warm, each prompt new. Seconds; `max_tokens` "
        f"{a.max_tokens}.",
        "",
        "| model | n | GGUF MB | rent | boot | join | fetch | load | first token | other | total (request → "
        "first token) | best total | warm TTFT | cold / warm |",
        "|---|---:|---:|" + "---:|" * 11,
    ]
    for k, rs in of.items():
        ph = {p: med([r.phases[p] for r in rs]) for p in PHASES}
        total, warm = med([r.total_s for r in rs]), med([r.warm_s for r in rs])
        out.append(
            f"| {k} | {len(rs)} | {size[k] / 1e6:.1f} | "
            + " | ".join(f"{ph[p]:.3f}" for p in PHASES)
            + f" | {med([r.other_s for r in rs]):.3f} | {total:.2f} | {min(r.total_s for r in rs):.2f} "
            f"| {warm:.3f} | {total / warm:.0f}x |"
        )
    out += [
        "",
        "Fetch against a plain download of the same file from the same server, by a process of its own, "
        "right before or after each cold start, alternately (median of rounds, and the best download against "
        "the best GET). The "
        "fetch's parts: resolve (Hub metadata: model info and a HEAD of the file, huggingface_hub imported), "
        "download, verify (sha256) and store. MB/s over the file's size:",
        "",
        "| model | fetch | resolve | download | verify + store | plain GET | plain GET + sha256 "
        "| fetch / (GET + sha256) | download / GET | best download / best GET | fetch MB/s | GET MB/s |",
        "|---|" + "---:|" * 11,
    ]
    for k, rs in of.items():
        if not all(r.plain_get_s for r in rs):
            continue  # the weights were on the volume: nothing was downloaded
        fetch, res, dl, ver = (
            med([r.phases["fetch"] for r in rs]),
            med([r.fetch_resolve_s for r in rs]),
            med([r.fetch_download_s for r in rs]),
            med([r.fetch_verify_s for r in rs]),
        )
        get, get_sha = med([r.plain_get_s for r in rs]), med([r.plain_get_sha_s for r in rs])
        best = min(r.fetch_download_s for r in rs) / min(r.plain_get_s for r in rs)
        mb = size[k] / 1e6
        out.append(
            f"| {k} | {fetch:.3f} | {res:.3f} | {dl:.3f} | {ver:.3f} | {get:.3f} | {get_sha:.3f} "
            f"| {fetch / get_sha:.2f}x | {dl / get:.2f}x | {best:.2f}x | {mb / fetch:.0f} | {mb / get:.0f} |"
        )
    out += [
        "",
        "Each cold start (a 0 plain GET: the weights were on the volume, none was made):",
        "",
        "| model | pod | GPU type | rent | boot | join | fetch | load | first token | total | warm TTFT "
        "| fetch's download | plain GET |",
        "|---|---|---|" + "---:|" * 10,
    ]
    for r in rounds:
        out.append(
            f"| {r.model} | {r.pod} | {r.gpu_type} | "
            + " | ".join(f"{r.phases[p]:.3f}" for p in PHASES)
            + f" | {r.total_s:.2f} | {r.warm_s:.3f} | {r.fetch_download_s:.3f} | {r.plain_get_s:.3f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="coderai-burst-"))
    t0 = time.monotonic()
    try:
        load = [loadavg()]
        rounds = run(root, a)
        load.append(loadavg())
        sizes = {k: build_model(k).stat().st_size for k in a.models}
        print(report(rounds, sizes, a, time.monotonic() - t0, (load[0], load[1])))
        bad = [(r.model, p, v) for r in rounds for p, v in r.phases.items() if not v > 0]
        if a.json:
            Path(a.json).write_text(
                json.dumps(
                    {
                        "rounds": [asdict(r) | {"warm_s": r.warm_s} for r in rounds],
                        "sizes": sizes,
                        "loadavg": load,
                        "args": vars(a),
                    },
                    indent=2,
                )
            )
        if bad:
            print(f"\nphases not measured as positive: {bad}", file=sys.stderr)
            return 1
    finally:
        if a.keep:
            print(f"\nwork dir (logs): {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
