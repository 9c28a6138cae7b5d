"""One GGUF three ways, in one run: whole on one machine, layer split and row split with a second machine's ggml
RPC server over a network-namespace link.

Two hosts in network namespaces joined by a veth bridge (`coderai.testing.netns`, needs root): node-b runs the
product's RPC service (the ggml RPC server as a child process behind the address-checked gate, exactly what a
worker started with `--rpc` offers); the head loads the model in the product's engines:

  local  `LlamaEngine`, every layer on the head's CPU
  layer  `SplitLlamaEngine`, a `SplitPlan` of half the layers on the head, half on node-b (through the gate)
  row    the same plan with `mode = row` (llama.cpp's RPC backend refuses row splits; the engine then serves a
         layer split, and the table says so)
  layer, no gate   the layer split straight to a bare ggml RPC server on node-b's address: what the gate costs

Each engine generates `--tokens` tokens at temperature 0 for `--rounds` prompts, measured interleaved (local,
layer, row, local, ...) so noise hits all alike. Prints tokens/s (decode) and time to first token per engine,
and each as a ratio to local. Every engine runs with one thread, and the RPC server with one thread, so each
host stands for a one-core machine; the link is a veth pair (no bandwidth cap: a fast LAN, not a 1 GbE one).

Usage: python bench/split.py [--dim 512 --layers 8] [--rounds 6] [--tokens 64] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Once upon a time in a small town",
    "The meaning of the cluster is",
    "def fibonacci(n):",
    "A short list of reasons to split a model:",
]


def serve_rpc(ip: str, port: int, peer: str) -> int:
    """On node-b: two of the worker's RPC services (child server + gate admitting `peer`), on `port` and
    `port + 1`, and a bare ggml RPC server on `port + 2` (no gate: what the gate costs), until stdin closes.
    Three, because a ggml RPC server serves one client at a time: every engine needs its own."""
    from coderai.engine_worker.rpc import RpcService
    from coderai.runtime.embedded import die_with_parent

    async def run() -> None:
        services = [RpcService(ip, port + i, threads=1) for i in range(2)]
        for svc in services:
            await svc.start()
            svc.gate.allow([peer])
        bare = subprocess.Popen(
            [sys.executable, "-m", "coderai.engine_worker.rpc_child", f"{ip}:{port + 2}", "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent(),
        )
        assert bare.stdout is not None  # stdout=PIPE
        bare.stdout.readline()  # printed just before it listens
        print("rpc ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        bare.kill()
        for svc in services:
            await svc.close()

    asyncio.run(run())
    return 0


def _unwatched():
    from coderai.engine_worker.engines.llama_split import SplitLlamaEngine

    class Unwatched(SplitLlamaEngine):
        """No liveness probe: a bare ggml RPC server has one client at a time and a probe would wait in its
        accept queue (the gate answers probes itself; that is one reason it exists)."""

        def _supervise(self) -> None:
            return

    return Unwatched


def measure(model: str, endpoint: str, rounds: int, tokens: int, n_layers: int) -> int:
    """On the head: the three engines, interleaved; one JSON line of results."""
    from coderai.contracts import CompletionJob, ModelConfig, SamplingParams
    from coderai.contracts.split import SplitDevice, SplitPlan
    from coderai.engine_worker.engines.base import CancelFlag
    from coderai.engine_worker.engines.llama import LlamaEngine
    from coderai.engine_worker.engines.llama_split import SplitLlamaEngine

    _Unwatched = _unwatched()
    params = {"n_ctx": 1024, "n_threads": 1, "prompt_cache_mb": 0}
    half = n_layers // 2
    host, _, port = endpoint.rpartition(":")

    def devices(server: int) -> list[SplitDevice]:
        return [
            SplitDevice(node_id="head", share=0.5, layers=list(range(half))),
            SplitDevice(
                node_id="node-b", endpoint=f"{host}:{int(port) + server}", share=0.5, layers=list(range(half, n_layers))
            ),
        ]

    engines = {
        "local": LlamaEngine(ModelConfig(name="m", engine="llama", path=model, params=params)),
        "layer": SplitLlamaEngine(
            ModelConfig(
                name="m",
                engine="llama",
                path=model,
                params=params,
                shards=SplitPlan(mode="layer", devices=devices(0), n_layers=n_layers),
            )
        ),
        "row": SplitLlamaEngine(
            ModelConfig(
                name="m",
                engine="llama",
                path=model,
                params=params,
                shards=SplitPlan(mode="row", devices=devices(1), n_layers=n_layers),
            )
        ),
        "layer, no gate": _Unwatched(
            ModelConfig(
                name="m",
                engine="llama",
                path=model,
                params=params,
                shards=SplitPlan(mode="layer", devices=devices(2), n_layers=n_layers),
            )
        ),
    }
    out: dict[str, dict] = {}
    texts: dict[str, list[str]] = {}
    for name, e in engines.items():
        t0 = time.perf_counter()
        e.load()
        out[name] = {
            "load_s": time.perf_counter() - t0,
            "decode_s": 0.0,
            "tokens": 0,
            "ttft": [],
            "note": getattr(e, "note", ""),
        }
        texts[name] = []
    for i in range(rounds):
        for name, e in engines.items():
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
            end = time.perf_counter()
            if stamps:
                out[name]["ttft"].append(stamps[0] - t0)
                out[name]["decode_s"] += end - stamps[0]
                out[name]["tokens"] += max(0, usage.completion_tokens - 1)
            texts[name].append("".join(pieces))
    for e in engines.values():
        e.close()
    same = {name: texts[name] == texts["local"] for name in engines}
    print(json.dumps({"results": out, "same_text": same}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="a tiny model and two short rounds: proves the script runs")
    ap.add_argument("--serve-rpc", nargs=3, metavar=("IP", "PORT", "PEER"), help=argparse.SUPPRESS)
    ap.add_argument("--measure", nargs=3, metavar=("MODEL", "ENDPOINT", "LAYERS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve_rpc:
        return serve_rpc(a.serve_rpc[0], int(a.serve_rpc[1]), a.serve_rpc[2])
    if a.measure:
        return measure(a.measure[0], a.measure[1], a.rounds, a.tokens, int(a.measure[2]))
    if a.smoke:
        a.dim, a.layers, a.rounds, a.tokens = 64, 2, 2, 8

    from coderai.testing.netns import Lab
    from coderai.tiny_models.llm import build_tiny_gguf

    work = Path(tempfile.mkdtemp(prefix="coderai-split-bench-"))
    model = work / "model.gguf"
    shape = build_tiny_gguf(model, dim=a.dim, layers=a.layers, heads=max(4, a.dim // 64))
    lab = Lab(["head", "node-b"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = None
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
    res, same = data["results"], data["same_text"]
    print(
        f"model: tiny GGUF dim {a.dim}, {a.layers} layers, {shape['bytes'] / 1e6:.1f} MB (f16); "
        f"{a.rounds} prompts x {a.tokens} tokens, temperature 0, one thread per engine and per RPC server\n"
    )
    print(
        "| engine | tokens/s | ratio to local | TTFT ms (median) | ratio to local | load s | same text as local | note |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base = res["local"]
    base_tps = base["tokens"] / base["decode_s"] if base["decode_s"] else 0.0
    base_ttft = sorted(base["ttft"])[len(base["ttft"]) // 2] if base["ttft"] else 0.0
    for name in ("local", "layer", "row", "layer, no gate"):
        x = res[name]
        tps = x["tokens"] / x["decode_s"] if x["decode_s"] else 0.0
        ttft = sorted(x["ttft"])[len(x["ttft"]) // 2] if x["ttft"] else 0.0
        print(
            f"| {name} | {tps:.1f} | {tps / base_tps if base_tps else 0:.2f} | {ttft * 1000:.1f} | "
            f"{ttft / base_ttft if base_ttft else 0:.2f} | {x['load_s']:.2f} | {'yes' if same[name] else 'NO'} | "
            f"{x['note'] or '-'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
