"""How llama-server's host prompt cache (`--cache-ram`) costs and pays over many distinct prompts.

For each `--cache-ram` size, a fresh bare `llama-server` (the one scripts/setup builds) gets N distinct prompts
from C loops; the table gives the median request time of the first and the last window of requests, the server's
resident memory at the end, and whether a prompt seen at the very start is still found in the cache at the end
(its `cached` prompt tokens), which is what the cache is for: a conversation that comes back after its slot was
taken by others.

  python bench/prompt_cache.py                          # the tiny GGUF, 8000 prompts, sizes 0,256,1024,8192 MiB
  python bench/prompt_cache.py --prompts 300 --sizes 0,64   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from _servers import Proc
from coderai.runtime.embedded import find_llama_server, free_port

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def prompt(i: int, words: int) -> str:
    """A prompt whose first tokens differ from every other one's (so no slot's KV is a prefix of it)."""
    return f"{i} " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def run(base: str, n: int, loops: int, words: int) -> tuple[list[float], int]:
    """Request times in send order, and the cached prompt tokens of prompt 0 asked again at the end."""
    times: list[float] = [0.0] * n
    counter = iter(range(1, n))

    async def loop(client: httpx.AsyncClient) -> None:
        for i in counter:
            t0 = time.monotonic()
            r = await client.post(
                "/v1/completions", json={"prompt": prompt(i, words), "max_tokens": 1, "cache_prompt": True}
            )
            r.raise_for_status()
            times[i] = time.monotonic() - t0

    clients = [httpx.AsyncClient(base_url=base, timeout=120) for _ in range(loops)]
    try:
        first = await clients[0].post("/v1/completions", json={"prompt": prompt(0, words), "max_tokens": 1})
        first.raise_for_status()
        await asyncio.gather(*(loop(c) for c in clients))
        again = (await clients[0].post("/v1/completions", json={"prompt": prompt(0, words), "max_tokens": 1})).json()
    finally:
        for c in clients:
            await c.aclose()
    return times[1:], int(again.get("timings", {}).get("cache_n", 0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a GGUF (default: the tiny random one, built here)")
    ap.add_argument("--prompts", type=int, default=8000)
    ap.add_argument("--loops", type=int, default=4, help="concurrent loops, also the server's slots (default 4)")
    ap.add_argument("--words", type=int, default=60, help="words a prompt (default 60)")
    ap.add_argument(
        "--sizes", default="0,256,1024,8192", help="--cache-ram values in MiB (8192 is llama.cpp's default)"
    )
    a = ap.parse_args(argv)
    binary = find_llama_server()
    if binary is None:
        print("no llama-server: run scripts/setup", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="coderai-prompt-cache-"))
    gguf = a.model
    if gguf is None:
        from coderai.tiny_models.llm import build_tiny_gguf

        gguf = Path(build_tiny_gguf(work / "tiny.gguf")["out"])
    rows = []
    window = max(1, a.prompts // 10)
    for size in [int(s) for s in a.sizes.split(",")]:
        port = free_port()
        proc = Proc(
            f"llama-server-{size}",
            [
                binary,
                "-m",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--parallel",
                str(a.loops),
                "--ctx-size",
                str(512 * a.loops),
                "--threads",
                "2",
                "--cache-ram",
                str(size),
                "--no-webui",
            ],
            work / "logs",
        )
        try:
            proc.wait_http(f"http://127.0.0.1:{port}/health", 60)
            t0 = time.monotonic()
            times, cached = asyncio.run(run(f"http://127.0.0.1:{port}", a.prompts, a.loops, a.words))
            took = time.monotonic() - t0
            rows.append(
                (
                    size,
                    1e3 * statistics.median(times[:window]),
                    1e3 * statistics.median(times[-window:]),
                    rss_mb(proc.pid),
                    cached,
                    took,
                )
            )
            print(f"[bench] cache-ram {size}: {rows[-1]}", file=sys.stderr, flush=True)
        finally:
            proc.stop()
    print(
        f"# llama-server --cache-ram over {a.prompts} distinct prompts ({a.loops} loops and slots, "
        f"{a.words} words each, max_tokens 1, {gguf.name})\n"
    )
    print(
        f"| --cache-ram MiB | first {window} p50 ms | last {window} p50 ms | RSS at end MiB | prompt 0 cached tokens at end | seconds |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for size, first, last, rss, cached, took in rows:
        print(f"| {size} | {first:.2f} | {last:.2f} | {rss:.0f} | {cached} | {took:.0f} |")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
