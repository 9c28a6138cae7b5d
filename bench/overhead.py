"""What coderai costs per request, side by side with LiteLLM proxy and the bare engine, in one run.

Part "real engine": the same tiny llama.cpp GGUF served three ways, all on 127.0.0.1:
  bare     python -m llama_cpp.server (llama-cpp-python's own OpenAI server): the baseline
  litellm  LiteLLM proxy (its own venv, one worker, a master key) forwarding to the bare server
  coderai  gateway (API keys) -> router -> llama worker, metrics with Redis, JSON logs at INFO
Part "routers": two bare `llama-server` replicas (the binary scripts/setup builds) of the tiny GGUF:
  ls-bare        one replica, asked directly: the baseline
  sglang-rr      `sglang-router launch --policy round_robin` (PyPI, Rust) in front of both replicas
  sglang-ca      the same with `--policy cache_aware`
  vllm-router    `vllm-router --policy round_robin` (PyPI, Rust) in front of both
  coderai-ls     coderai with the model on its llama-server engine on two workers (the same server flags)
Part "pure orchestration": no model work at all, so the orchestrator is the bottleneck:
  litellm  the same proxy answering from `mock_response`: the baseline
  coderai  the same stack, model `echo` on a worker with CODERAI_WORKER_FAMILIES=echo (coderai.testing)

Load comes from wrk (one thread, -c = concurrency), cells interleaved path by path (A B C, then C B A, ...) so
machine noise hits every path alike. Server CPU per request is read from /proc for each path's process trees.
Streaming TTFT and inter-token gap come from an httpx client at concurrency 1. Prints markdown tables.

  python bench/overhead.py            # full run: installs wrk, llama_cpp.server's extra and LiteLLM if missing
  python bench/overhead.py --smoke    # seconds: a few requests per path, installs nothing, skips what is absent
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import _load
import _report
import _setup
from _servers import Coderai, Target, start_bare, start_litellm, start_llama_replica, start_router
from coderai.runtime.embedded import find_llama_server

ROUTER_PATHS = (
    ("sglang-rr", "sglang-router", "round_robin"),
    ("sglang-ca", "sglang-router", "cache_aware"),
    ("vllm-router", "vllm-router", "round_robin"),
)
LS_SLOTS = 4

MOCK_WORDS = 16  # LiteLLM's mock reply has as many words as the echo engine answers with max_tokens
# llama_cpp.server samples with repeat_penalty 1.1 unless told, in-process llama-cpp-python with 1.0: the same
# value everywhere makes every path generate the very same tokens (coderai ignores the unknown field, as its
# engine's default is 1.0 already)
REAL_EXTRA = {"repeat_penalty": 1.0}


def _csv_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _variant(s: str) -> tuple[str, dict[str, str]]:
    name, sep, pairs = s.partition(":")
    env = dict(p.split("=", 1) for p in pairs.split(",") if "=" in p)
    if not sep or not name or not env:
        raise argparse.ArgumentTypeError(f"{s!r}: want NAME:KEY=VALUE[,KEY=VALUE]")
    return name, env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a few requests per path; no installs; seconds, not minutes")
    ap.add_argument("--parts", default="real,pure,routers", help="which parts to run (default: real,pure,routers)")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per wrk cell (default 5)")
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds per cell; the median is shown (default 3)"
    )
    ap.add_argument("--concurrency", type=_csv_ints, default=[1, 8, 64], help="real part (default 1,8,64)")
    ap.add_argument("--pure-concurrency", type=_csv_ints, default=[1, 64], help="pure part (default 1,64)")
    ap.add_argument("--stream-requests", type=int, default=40, help="streamed requests per path and round for TTFT/gap")
    ap.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request (default 16)")
    ap.add_argument("--n-threads", type=int, default=1, help="llama.cpp threads, the same for every path (default 1)")
    ap.add_argument("--gateway-workers", type=int, default=1, help="coderai gateway HTTP workers (default 1)")
    ap.add_argument(
        "--load",
        choices=["wrk", "python"],
        default="wrk",
        help="load generator; python is a weak stand-in for smoke runs without wrk (default wrk)",
    )
    ap.add_argument("--no-install", action="store_true", help="install nothing; skip paths whose tools are missing")
    ap.add_argument("--json", type=Path, help="also write every measurement to this file")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs of every server)")
    ap.add_argument(
        "--baseline-tree",
        type=Path,
        help="another checkout with its own .venv (e.g. the commit before a change): its stack joins the "
        "pure part as path `coderai-base`, measured interleaved with this one",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        type=_variant,
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="another coderai stack whose services get these environment variables (e.g. "
        "`rust-tasks:CODERAI_GATEWAY_TASK_IMPL=rust`): a path of its own in the routers and pure parts, measured "
        "interleaved with the others; repeatable",
    )
    a = ap.parse_args(argv)
    if a.smoke:
        a.duration, a.rounds, a.stream_requests = 1.0, 1, 3
        a.concurrency, a.pure_concurrency, a.no_install = [1], [1], True
    return a


class Runner:
    """Runs one part's cells interleaved and keeps what they measured."""

    def __init__(self, a: argparse.Namespace, wrk: str | None, work: Path) -> None:
        self.a = a
        self.wrk = wrk
        self.work = work

    def cell(self, t: Target, conc: int, stream: bool) -> _load.Cell:
        body = _load.body_for(t, self.a.max_tokens, stream)
        if self.wrk:
            return _load.wrk_cell(self.wrk, t, body, conc, self.a.duration, self.work)
        return _load.py_cell(t, body, conc, max(3, conc))

    def part(self, title: str, targets: list[Target], concs: list[int]) -> tuple[dict, dict, dict]:
        cells: dict[tuple[str, int, bool], list[_load.Cell]] = defaultdict(list)
        runs: dict[str, list[_load.StreamRun]] = defaultdict(list)
        tokens = {t.name: _load.check(t, self.a.max_tokens) for t in targets}
        for t in targets:  # warm every path (connections, caches) before anything is measured
            _load.stream_probe(t, self.a.max_tokens, 2)
        for r in range(self.a.rounds):
            order = targets if r % 2 == 0 else targets[::-1]
            for stream in (False, True):
                for conc in concs:
                    for t in order:
                        c = self.cell(t, conc, stream)
                        cells[(t.name, conc, stream)].append(c)
                        print(
                            f"[bench] {title} round {r + 1} {t.name:8} c={conc:<3} stream={int(stream)} "
                            f"{c.requests / c.seconds:8.0f} req/s p50 {c.p50_ms:7.2f} ms",
                            file=sys.stderr,
                            flush=True,
                        )
            for t in order:
                runs[t.name] += _load.stream_probe(t, self.a.max_tokens, self.a.stream_requests)
        rows = {k: _report.aggregate(v) for k, v in cells.items()}
        probes = {k: _report.summarize(v) for k, v in runs.items()}
        return rows, probes, tokens


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    parts = {p.strip() for p in a.parts.split(",")}
    install = not a.no_install
    notes: list[str] = []
    wrk = _setup.ensure_wrk(install) if a.load == "wrk" else None
    if not wrk:
        if not a.smoke:
            print("wrk is required for a full run (apt-get install -y wrk)", file=sys.stderr)
            return 2
        notes.append("no wrk: load came from the Python fallback client (its numbers are not comparable)")
    bare_ok = _setup.llama_server_ready(install) if "real" in parts else "real part not asked for"
    # LiteLLM is a baseline of the real and pure parts only: the routers part neither installs nor starts it
    litellm = _setup.litellm_bin(install) if parts & {"real", "pure"} else None
    if isinstance(litellm, str):
        notes.append(f"LiteLLM skipped: {litellm}")
        litellm = None
    if "real" in parts and bare_ok is not True:
        notes.append(f"bare engine skipped: {bare_ok}")
    routers: dict = {}
    if "routers" in parts:
        found = _setup.rust_routers(install)
        if find_llama_server() is None:
            notes.append("routers part skipped: no llama-server (scripts/setup builds it)")
            parts.discard("routers")
        elif isinstance(found, str):
            notes.append(f"Rust routers skipped: {found}")
        else:
            routers = found

    work = Path(tempfile.mkdtemp(prefix="coderai-overhead-"))
    started: list = []
    coderai = Coderai(work)
    base = None
    if a.baseline_tree is not None:
        python = a.baseline_tree / ".venv" / "bin" / "python"
        if not python.exists():
            print(f"--baseline-tree: {python} does not exist (run that checkout's scripts/setup)", file=sys.stderr)
            return 2
        base = Coderai(work / "base", python=str(python))
    variants = [(name, Coderai(work / f"variant-{name}", extra_env=env)) for name, env in a.variant]
    t_start = time.monotonic()
    quiet = os.getloadavg()
    notes.append(f"load average before anything started: {quiet[0]:.2f} (1 min), {quiet[1]:.2f} (5 min)")
    out: dict = {"machine": _setup.machine(), "versions": _setup.versions(litellm), "args": sys.argv[1:]}
    try:
        gguf = None
        if parts & {"real", "routers"}:
            from coderai.tiny_models.llm import build_tiny_gguf

            gguf = Path(build_tiny_gguf(work / "tiny.gguf")["out"])
        bare = None
        if gguf is not None and bare_ok is True:
            proc, bare = start_bare(work, gguf, a.n_threads, 512)
            started.append(proc)
        lite = None
        if litellm is not None:
            mock = " ".join(["tok"] * MOCK_WORDS)
            proc, lite = start_litellm(work, litellm, bare.base_url if bare else None, mock)
            started.append(proc)
        replicas: list[Target] = []
        if "routers" in parts:
            binary = find_llama_server()
            for r in range(2):
                proc, t = start_llama_replica(work, binary, gguf, f"ls-{r}", a.n_threads, LS_SLOTS, 512, 256)
                started.append(proc)
                replicas.append(t)
        ls_params = {
            "parallel": LS_SLOTS,
            "n_ctx": 512,
            "n_threads": a.n_threads,
            "n_threads_batch": a.n_threads,
            "cache_ram_mb": 256,
            "queue": 128,
        }  # queue: the bare replicas queue without bound too
        for stack in [coderai] + [v for _, v in variants]:  # a variant serves what coderai serves
            stack.start(
                gguf if "real" in parts else None,
                a.n_threads,
                512,
                a.gateway_workers,
                ls_params=ls_params if "routers" in parts else None,
                ls_gguf=gguf,
            )
        if base is not None and "pure" in parts:
            base.start_models(
                [{"name": "echo", "engine": "echo", "path": "-", "nodes": ["echo"]}], [], a.gateway_workers, echo=True
            )
        runner = Runner(a, wrk, work)
        print(f"[bench] everything up in {time.monotonic() - t_start:.0f}s; measuring", file=sys.stderr, flush=True)

        tables: list[str] = []
        pure: dict = {}
        routed: dict = {}
        router_probes: dict = {}

        def measure(part: str, title: str, targets: list, conc, baseline: str, note: str = "") -> tuple[dict, dict]:
            """Run one part, add its load and streaming tables, record it in the JSON output."""
            cpu_before = _setup.cpu_times()
            rows, probes, tokens = runner.part(part, targets, conc)
            load = _setup.load_note(cpu_before, _setup.cpu_times())
            order = [t.name for t in targets]
            tables.extend(
                [
                    f"## {title}; baseline: {baseline}{note}",
                    "",
                    f"_{load}_",
                    "",
                    _report.load_table(rows, order, baseline),
                    "",
                    "Streaming at concurrency 1 (httpx client):",
                    "",
                    _report.probe_table(probes, tokens, order, baseline),
                    "",
                ]
            )
            out[part] = {
                "rows": _rows_json(rows),
                "probes": {k: asdict(v) for k, v in probes.items()},
                "tokens": tokens,
                "load": load,
            }
            return rows, probes

        if gguf is not None and "real" in parts:
            targets = [t for t in (bare, lite if bare else None, coderai.target("coderai", "tiny")) if t is not None]
            for t in targets:
                t.extra_body = dict(REAL_EXTRA)
            measure("real", "Real engine (tiny llama.cpp GGUF)", targets, a.concurrency, "bare")
        if "routers" in parts:
            bare_ls = Target("ls-bare", replicas[0].base_url, "bench", pids=[replicas[0].pids[0]])
            targets = [bare_ls]
            for name, kind, policy in ROUTER_PATHS if routers else ():
                proc, t = start_router(work, routers[kind], name, policy, replicas, retries=False)
                started.append(proc)
                t.pids += [r.pids[0] for r in replicas]
                targets.append(t)
            targets.append(coderai.target("coderai-ls", "tiny-ls"))
            targets += [v.target(f"{name}-ls", "tiny-ls") for name, v in variants]
            for t in targets:
                t.extra_body = dict(REAL_EXTRA)
            routed, router_probes = measure(
                "routers",
                "Rust routers and coderai in front of llama-server replicas",
                targets,
                a.concurrency,
                "ls-bare",
            )
        if "pure" in parts:
            echo_lite = Target("litellm", lite.base_url, "echo", lite.headers, [lite.pids[0]]) if lite else None
            targets = [
                t
                for t in (
                    echo_lite,
                    coderai.target("coderai", "echo"),
                    base.target("coderai-base", "echo") if base and base.stack else None,
                )
                if t is not None
            ] + [v.target(name, "echo") for name, v in variants]
            pure, _ = measure(
                "pure", "Pure orchestration (no model work)", targets, a.pure_concurrency, "litellm", " (mock_response)"
            )
        out["targets"] = _report.targets(pure, routed, router_probes)
        if out["targets"] and not a.smoke and wrk:
            tables += ["## Targets of the hot path (issue 42)", "", *out["targets"], ""]
    finally:
        coderai.stop()
        if base is not None:
            base.stop()
        for _, v in variants:
            v.stop()
        for p in reversed(started):
            p.stop()
    m = out["machine"]
    print(f"# coderai overhead ({'smoke' if a.smoke else 'full'} run, {time.monotonic() - t_start:.0f}s)\n")
    print(
        f"Machine: {m['nproc']} CPUs ({m['cpu']}), {m['memory']}, Python {m['python']}; "
        + ", ".join(f"{k} {v}" for k, v in out["versions"].items())
    )
    print(
        f"Cells: {a.duration:g}s x {a.rounds} rounds, max_tokens {a.max_tokens}, llama.cpp threads {a.n_threads}, "
        f"gateway workers {a.gateway_workers}\n"
    )
    for n in notes:
        print(f"> {n}")
    if notes:
        print()
    print("\n".join(tables))
    if a.json:
        out["notes"] = notes
        a.json.write_text(json.dumps(out, indent=2))
    if a.keep:
        print(f"work dir (logs): {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


def _rows_json(rows: dict) -> list[dict]:
    return [{"path": n, "conc": c, "stream": s, **asdict(v)} for (n, c, s), v in rows.items()]


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
