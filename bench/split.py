"""One GGUF three ways, in one run: whole on one machine's `llama-server`, and layer and row split with a second
machine's llama.cpp `rpc-server` over a network-namespace link, at concurrency 1 and 8.

Two hosts in network namespaces joined by a veth bridge (`coderai.testing.netns`, needs root): node-b runs the
product's RPC service (`rpc-server` behind the address-checked gate, exactly what a worker started with `--rpc`
offers once a split is placed on it); the head runs the model in the product's engines:

  local  `LlamaServerEngine`, every layer on the head's CPU
  layer  `SplitServerEngine` (llama-server --rpc), a `SplitPlan` of half the layers on the head, half on node-b
  row    the same plan with `mode = row` (llama.cpp's RPC backend refuses row splits; the engine then serves a
         layer split, and the table says so)
  layer, no gate   the layer split straight to a bare `rpc-server` on node-b's address: what the gate costs

At each concurrency c, each round sends c completions at once to each engine in turn (local, layer, row, ...,
then the next round), so noise hits all alike. Prints aggregate tokens/s (completion tokens over the wall time of
the c requests), the median time to first token, each as a ratio to local, and whether the split answered the
very text the whole model did (at c=1, temperature 0). Every server runs `--parallel 8` with `--threads 1`, and
each RPC server one thread, so each host stands for a one-core machine; the link is a veth pair (no bandwidth
cap: a fast LAN, not a 1 GbE one).

Usage: python bench/split.py [--dim 512 --layers 8 | --real] [--rounds 3] [--tokens 64] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Once upon a time in a small town",
    "The meaning of the cluster is",
    "def fibonacci(n):",
    "A short list of reasons to split a model:",
]


LEVELS = (1, 8)


def serve_rpc(ip: str, port: int, peer: str) -> int:
    """On node-b: two of the worker's RPC services (gate admitting `peer`, rpc-server behind it), on `port` and
    `port + 1`, and a bare rpc-server on `port + 2` (no gate: what the gate costs), until stdin closes. Three,
    because an rpc-server serves one client at a time: every engine needs its own."""
    from coderai.engine_worker.rpc import RpcService, find_rpc_server, until_listening
    from coderai.runtime.embedded import die_with_parent

    binary = find_rpc_server()
    if binary is None:
        raise SystemExit("no rpc-server: run scripts/setup (it builds .venv/bin/rpc-server)")

    async def run() -> None:
        services = [RpcService(ip, port + i, threads=1) for i in range(2)]
        for svc in services:
            await svc.start()
            await svc.admit([peer])
        bare = subprocess.Popen(
            [binary, "--host", ip, "--port", str(port + 2), "--threads", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent(),
        )
        await until_listening(port + 2, bare, host=ip)
        print("rpc ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        bare.kill()
        for svc in services:
            await svc.close()

    asyncio.run(run())
    return 0


def _engines(model: str, endpoint: str, n_layers: int) -> dict:
    from coderai.contracts import ModelConfig
    from coderai.contracts.split import SplitDevice, SplitPlan
    from coderai.engine_worker.engines.llama_server import LlamaServerEngine
    from coderai.engine_worker.engines.llama_split import SplitServerEngine

    class Unwatched(SplitServerEngine):
        """No liveness probe: a bare rpc-server has one client at a time and a probe would wait in its accept
        queue (the gate answers probes itself; that is one reason it exists)."""

        def _watch_rpc(self) -> None:
            return

    params = {"n_ctx": 512, "n_threads": 1, "parallel": max(LEVELS), "head_snapshots_mb": 0, "cache_ram_mb": 0}
    half = n_layers // 2
    host, _, port = endpoint.rpartition(":")

    def cfg(mode: str = "", server: int = 0) -> ModelConfig:
        if not mode:
            return ModelConfig(name="m", engine="llama-server", path=model, params=params)
        devices = [
            SplitDevice(node_id="head", share=0.5, layers=list(range(half))),
            SplitDevice(
                node_id="node-b", endpoint=f"{host}:{int(port) + server}", share=0.5, layers=list(range(half, n_layers))
            ),
        ]
        shards = SplitPlan(mode=mode, devices=devices, n_layers=n_layers)
        return ModelConfig(name="m", engine="llama-server", path=model, params=params, shards=shards)

    return {
        "local": LlamaServerEngine(cfg()),
        "layer": SplitServerEngine(cfg("layer", 0)),
        "row": SplitServerEngine(cfg("row", 1)),
        "layer, no gate": Unwatched(cfg("layer", 2)),
    }


def _one(e, name: str, i: int, tokens: int) -> tuple[int, float, str]:
    """(completion tokens, time to first token, text) of one streamed completion."""
    from coderai.contracts import CompletionJob, SamplingParams
    from coderai.engine_worker.engines.base import CancelFlag

    job = CompletionJob(
        request_id=f"{name}{i}",
        model="m",
        prompt=PROMPTS[i % len(PROMPTS)],
        stream=True,
        params=SamplingParams(max_tokens=tokens, temperature=0.0),
    )
    stamps: list[float] = []
    pieces: list[str] = []
    t0 = time.perf_counter()
    _, usage = e.complete(
        job, CancelFlag(), lambda d, t, f: (stamps.append(time.perf_counter()), pieces.append(t or ""))
    )
    return usage.completion_tokens, (stamps[0] - t0) if stamps else 0.0, "".join(pieces)


def measure(model: str, endpoint: str, rounds: int, tokens: int, n_layers: int) -> int:
    """On the head: the engines, interleaved per round, at each concurrency; one JSON line of results."""
    engines = _engines(model, endpoint, n_layers)
    out: dict[str, dict] = {}
    texts: dict[str, list[str]] = {name: [] for name in engines}
    for name, e in engines.items():
        t0 = time.perf_counter()
        e.load()
        out[name] = {"load_s": time.perf_counter() - t0, "note": getattr(e, "note", "")}
        out[name].update({f"c{c}": {"tokens": 0, "wall_s": 0.0, "ttft": []} for c in LEVELS})
    with ThreadPoolExecutor(max(LEVELS)) as pool:
        for c in LEVELS:
            for i in range(rounds):
                for name, e in engines.items():
                    t0 = time.perf_counter()
                    done = list(pool.map(lambda k, e=e, name=name: _one(e, name, i * c + k, tokens), range(c)))
                    cell = out[name][f"c{c}"]
                    cell["wall_s"] += time.perf_counter() - t0
                    cell["tokens"] += sum(n for n, _, _ in done)
                    cell["ttft"] += [t for _, t, _ in done]
                    if c == 1:
                        texts[name].append(done[0][2])
    for e in engines.values():
        e.close()
    same = {name: texts[name] == texts["local"] for name in engines}
    print(json.dumps({"results": out, "same_text": same}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="a tiny model and two short rounds: proves the script runs")
    ap.add_argument(
        "--real", action="store_true", help="the real K-quant GGUF (Gemma 3 270M Q4_K_M, the dev extra) instead"
    )
    ap.add_argument("--serve-rpc", nargs=3, metavar=("IP", "PORT", "PEER"), help=argparse.SUPPRESS)
    ap.add_argument("--measure", nargs=3, metavar=("MODEL", "ENDPOINT", "LAYERS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve_rpc:
        return serve_rpc(a.serve_rpc[0], int(a.serve_rpc[1]), a.serve_rpc[2])
    if a.measure:
        return measure(a.measure[0], a.measure[1], a.rounds, a.tokens, int(a.measure[2]))
    if a.smoke:
        a.dim, a.layers, a.rounds, a.tokens = 64, 2, 2, 8

    from _setup import cpu_times, load_note

    from coderai.testing.netns import Lab
    from coderai.tiny_models.llm import build_tiny_gguf

    work = Path(tempfile.mkdtemp(prefix="coderai-split-bench-"))  # removed at the end
    model = work / "model.gguf"
    if a.real:
        from coderai.runtime.gguf_meta import block_count
        from coderai.testing.real_gguf import gemma3_q4km

        model = gemma3_q4km()
        a.layers = block_count(str(model))
        described = f"Gemma 3 270M Q4_K_M, {a.layers} layers, {model.stat().st_size / 1e6:.1f} MB"
    else:
        shape = build_tiny_gguf(model, dim=a.dim, layers=a.layers, heads=max(4, a.dim // 64))
        described = f"tiny GGUF dim {a.dim}, {a.layers} layers, {shape['bytes'] / 1e6:.1f} MB (f16)"
    lab = Lab(["head", "node-b"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = None
    times = [cpu_times()]
    try:
        head, nb = lab["head"], lab["node-b"]
        server = subprocess.Popen(
            nb.prefix() + [sys.executable, __file__, "--serve-rpc", nb.ip, "50052", head.ip],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert server.stdout is not None and server.stdin is not None  # both PIPE
        line = server.stdout.readline()
        if "rpc ready" not in line:
            raise SystemExit(f"node-b's RPC service did not start: {line!r}")
        r = subprocess.run(
            head.prefix()
            + [
                sys.executable,
                __file__,
                "--measure",
                str(model),
                f"{nb.ip}:50052",
                str(a.layers),
                "--rounds",
                str(a.rounds),
                "--tokens",
                str(a.tokens),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
        )
        if r.returncode != 0:
            raise SystemExit(f"measuring failed:\n{r.stderr[-4000:]}")
        data = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        if server is not None and server.stdin is not None:
            server.stdin.close()
            server.wait(30)
        lab.close()
        shutil.rmtree(work, ignore_errors=True)
    times.append(cpu_times())
    res, same = data["results"], data["same_text"]
    print(
        f"model: {described}; {a.rounds} rounds of "
        f"{a.tokens}-token completions, temperature 0; --threads 1 per server and per RPC server\n{load_note(*times)}\n"
    )
    print(
        "| engine | c | tokens/s (aggregate) | ratio to local | TTFT ms (median) | ratio to local | load s | same text as local (c=1) | note |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c in LEVELS:
        base = res["local"][f"c{c}"]
        base_tps = base["tokens"] / base["wall_s"] if base["wall_s"] else 0.0
        base_ttft = statistics.median(base["ttft"]) if base["ttft"] else 0.0
        for name in ("local", "layer", "row", "layer, no gate"):
            x = res[name][f"c{c}"]
            tps = x["tokens"] / x["wall_s"] if x["wall_s"] else 0.0
            ttft = statistics.median(x["ttft"]) if x["ttft"] else 0.0
            print(
                f"| {name} | {c} | {tps:.1f} | {tps / base_tps if base_tps else 0:.2f} | {ttft * 1000:.1f} | "
                f"{ttft / base_ttft if base_ttft else 0:.2f} | {res[name]['load_s']:.2f} | "
                f"{'yes' if same[name] else 'NO'} | {res[name]['note'] or '-'} |"
            )
    for name in ("local", "layer"):
        one, eight = (res[name][f"c{c}"] for c in LEVELS)
        if one["wall_s"] and eight["wall_s"]:
            scale = (eight["tokens"] / eight["wall_s"]) / (one["tokens"] / one["wall_s"])
            print(f"\n{name}: c={LEVELS[1]} gives {scale:.2f}x the tokens/s of c=1", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
