"""Where a request's time goes in coderai: py-spy samples every service on the hot path during a wrk cell.

The same stack as `bench/overhead.py` (API keys, metrics with Redis, JSON logs at INFO) serves a model under load
from wrk for `--duration` seconds while `py-spy record` samples each Python service (gateway with its granian
workers, router, the serving worker, metrics, scheduler). Prints, per service: the CPU it spent per request
(from /proc, its children included) and its top frames by own samples and by inclusive samples. Writes the raw
collapsed stacks under the work dir (`--keep`), which flame-graph tools read.

  python bench/hotpath.py                        # echo engine (pure orchestration), c=64, 10 s
  python bench/hotpath.py --model ls --conc 1    # the tiny GGUF on two llama-server workers, c=1
  python bench/hotpath.py --stream --keep        # streamed; keep the stacks and the logs

Installs what it lacks: Debian's `wrk` (as root) and `py-spy` from PyPI into this venv.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import _load
import _setup
from _servers import Coderai, own_cpu_s, tree_cpu_s

SERVICES = ("gateway", "router", "worker-echo", "worker-ls1", "worker-ls2", "metrics", "scheduler")


def ensure_py_spy() -> str:
    found = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if found:
        return found
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "py-spy"], check=True)
    return shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["echo", "ls"], default="echo", help="echo engine, or tiny GGUF on llama-server")
    ap.add_argument("--conc", type=int, default=64, help="wrk connections (default 64)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds sampled (default 10)")
    ap.add_argument("--stream", action="store_true", help="streamed chats")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second (default 250)")
    ap.add_argument("--top", type=int, default=12, help="frames listed per service (default 12)")
    ap.add_argument("--json", type=Path, help="also write the tables' data here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (stacks, logs)")
    ap.add_argument("--smoke", action="store_true", help="2 s, c=4, installs nothing (Python load without wrk)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.duration, a.conc = 2.0, 4
    return a


def frames(collapsed: Path) -> tuple[collections.Counter, collections.Counter, int]:
    """Own and inclusive samples per frame from py-spy's raw (collapsed) output; the total samples."""
    own: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        count = int(n)
        parts = [short(f) for f in stack.split(";")[1:]]  # the first part is the process/thread
        total += count
        if parts:
            own[parts[-1]] += count
        for f in set(parts):
            incl[f] += count
    return own, incl, total


def short(frame: str) -> str:
    """`fn (path/to/module.py:12)` as `fn (module.py)`: lines differ per sample, the function is what counts."""
    name, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(file).parts
    keep = "/".join(parts[-2:]) if "site-packages" in parts or "python3" in file else Path(file).name
    return f"{name} ({keep})"


ID = re.compile(r"^(?:[0-9a-f]{8,}|[A-Za-z0-9_-]{20,}|\d+|_INBOX|[A-Za-z0-9]{22})$")


def pattern(subject: str) -> str:
    """A subject with its ids as `*` (inboxes, request ids, node ids), so one request's messages group by kind."""
    if subject.startswith("_INBOX."):
        return "_INBOX.> (replies)"
    return ".".join("*" if ID.match(t) else t for t in subject.split("."))


def count_messages(nats_url: str, run: Callable[[], _load.Cell]) -> tuple[collections.Counter, _load.Cell]:
    """Every message on the bus while `run` puts load on the stack, by subject pattern: how many messages one
    request costs, a number that does not depend on how busy the machine is."""
    import nats

    async def go() -> tuple[collections.Counter, _load.Cell]:
        seen: collections.Counter = collections.Counter()
        nc = await nats.connect(nats_url)

        async def on(msg) -> None:
            seen[pattern(msg.subject)] += 1

        await nc.subscribe(">", cb=on)
        await nc.flush()
        cell = await asyncio.to_thread(run)
        await nc.flush()
        await nc.drain()
        return seen, cell

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    wrk = _setup.ensure_wrk(not a.smoke)
    if not wrk and not a.smoke:
        print("wrk is required (apt-get install -y wrk)", file=sys.stderr)
        return 2
    py_spy = ensure_py_spy()
    work = Path(tempfile.mkdtemp(prefix="coderai-profile-"))
    coderai = Coderai(work)
    out: dict = {"args": sys.argv[1:], "services": {}}
    try:
        if a.model == "echo":
            coderai.start(None, 1, 512, 1)
            target = coderai.target("coderai", "echo")
        else:
            from coderai.tiny_models.llm import build_tiny_gguf

            gguf = Path(build_tiny_gguf(work / "tiny.gguf")["out"])
            params = {"parallel": 4, "n_ctx": 512, "n_threads": 1, "n_threads_batch": 1, "cache_ram_mb": 256}
            coderai.start(None, 1, 512, 1, ls_params=params | {"queue": 128}, ls_gguf=gguf)
            target = coderai.target("coderai", "tiny-ls")
        assert coderai.stack is not None
        pids = {n: p.proc.pid for n, p in coderai.stack.procs.items() if p.proc is not None and n in SERVICES}
        others = {  # not Python, so not sampled: their CPU is counted
            n: s.proc.pid
            for n, s in (("nats-server", coderai.nats), ("redis-server", coderai.redis))
            if s is not None and s.proc is not None
        }
        body = _load.body_for(target, 16, a.stream)

        def load(seconds: float) -> _load.Cell:
            if wrk:
                return _load.wrk_cell(wrk, target, body, a.conc, seconds, work)
            return _load.py_cell(target, body, a.conc, int(seconds * 100))  # --smoke without wrk: a few requests

        load(3)  # warm: connections, caches
        cpu0 = {n: tree_cpu_s([p]) for n, p in (pids | others).items()}
        own0 = {n: own_cpu_s(p) for n, p in (pids | others).items()}
        spies = {
            n: subprocess.Popen(
                [py_spy, "record", "--format", "raw", "--nonblocking", "--subprocesses", "-r", str(a.rate)]
                + ["-d", str(round(a.duration)), "-p", str(p), "-o", str(work / f"{n}.txt")],
                stdout=subprocess.DEVNULL,
                stderr=open(work / f"{n}.py-spy.log", "w"),
            )
            for n, p in pids.items()
        }
        cell = load(a.duration)
        cpu = {n: tree_cpu_s([p]) - cpu0[n] for n, p in (pids | others).items()}
        own = {n: own_cpu_s(p) - own0[n] for n, p in (pids | others).items()}
        for s in spies.values():
            s.wait(timeout=a.duration + 60)
        assert coderai.nats is not None
        seen, counted = count_messages(coderai.nats.url, lambda: load(min(3.0, a.duration)))
    finally:
        coderai.stop()
    req = max(1, cell.requests)
    load = os.getloadavg()
    print(f"# Where the time goes: {target.model}, c={a.conc}, {'streamed' if a.stream else 'whole answers'}\n")
    print(
        f"{cell.requests / cell.seconds:,.0f} req/s, p50 {cell.p50_ms:.2f} ms over {cell.seconds:.1f} s; "
        f"load average {load[0]:.2f} after; py-spy at {a.rate} Hz (its own cost is in the CPU column)\n"
    )
    print("| service | CPU ms/req, with its children | of which its children's |")
    print("|---|---:|---:|")
    for n in cpu:
        print(f"| {n} | {1e3 * cpu[n] / req:.3f} | {1e3 * max(0.0, cpu[n] - own[n]) / req:.3f} |")
    print(
        f"| all | {1e3 * sum(cpu.values()) / req:.3f} | {1e3 * max(0.0, sum(cpu.values()) - sum(own.values())) / req:.3f} |\n"
    )
    print("(children: a worker's `llama-server`, the gateway's granian workers)\n")
    per = max(1, counted.requests)
    print(f"Bus messages per request ({counted.requests} requests, a separate cell with a subscriber on `>`):\n")
    print("| subject | messages/request |")
    print("|---|---:|")
    for subj, n in seen.most_common(20):
        print(f"| `{subj}` | {n / per:.2f} |")
    print(f"| all | {sum(seen.values()) / per:.2f} |\n")
    for n in pids:
        stacks = work / f"{n}.txt"
        if not stacks.exists():
            print(f"## {n}: no samples ({(work / f'{n}.py-spy.log').read_text()[-300:]})\n")
            continue
        own, incl, total = frames(stacks)
        print(f"## {n}: {total} samples ({1e3 * cpu[n] / req:.3f} ms CPU a request)\n")
        print("| own % | frame | | incl % | frame |")
        print("|---:|---|---|---:|---|")
        # inclusive: past the roots every sample goes through (the event loop, the thread's entry)
        inner = [(f, v) for f, v in incl.most_common() if v < 0.9 * total][: a.top]
        tops = zip(own.most_common(a.top), inner, strict=False)
        for (f1, v1), (f2, v2) in tops:
            print(f"| {100 * v1 / total:.1f} | `{f1}` | | {100 * v2 / total:.1f} | `{f2}` |")
        print()
        out["services"][n] = {
            "cpu_ms_per_req": 1e3 * cpu[n] / req,
            "children_cpu_ms_per_req": 1e3 * max(0.0, cpu[n] - own[n]) / req,
            "samples": total,
            "own": own.most_common(40),
            "inclusive": incl.most_common(60),
        }
    out["bus_messages_per_request"] = {k: v / per for k, v in seen.items()}
    out["cell"] = {"requests": cell.requests, "seconds": cell.seconds, "p50_ms": cell.p50_ms}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    if a.keep:
        print(f"work dir (stacks, logs): {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    _setup.run_main(main, "profile")
