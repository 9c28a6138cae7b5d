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
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from coderai.contracts import ModelFetch
from coderai.runtime.bus import Bus
from coderai.runtime.embedded import NatsServer
from coderai.runtime.embedded_redis import RedisServer
from coderai.testing.stack import Stack, write_models_file

from _burst_report import Round, loadavg, report
from _burst_requests import Answer, plain_download, stream_chat
from _burst_seen import Seen, pod_launcher

SHAPES = {"small": {"dim": 64, "layers": 2, "heads": 4}, "1gb": {"dim": 2048, "layers": 10, "heads": 16, "ff": 5632}}
RECIPE = "1"  # bump when SHAPES or the builder change: the cached GGUFs are rebuilt
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


# --- one cold start ---------------------------------------------------------------------------------------------


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
