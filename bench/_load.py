"""Load for the overhead bench: wrk cells (latency, requests/s), a Python fallback, and a streaming probe.

wrk is the generator for numbers: it is C and far lighter than any server measured, so it is never the
bottleneck. The Python fallback exists only so `--smoke` runs where wrk is not installed. Streaming timing
(time to first token, gaps between tokens) needs the body as it arrives, which wrk does not expose: a plain
httpx client reads it at concurrency 1, the same client for every path.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from _servers import Target, tree_cpu_s

LUA = """wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
{headers}
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('BENCH {{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, ' ..
    '"errors": %d}}\\n', summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.status + e.timeout))
end
"""


@dataclass
class Cell:
    """One measured run of one path at one concurrency."""

    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_s: float


def _lua_str(s: str) -> str:
    return "[==[" + s + "]==]"  # a Lua long string: no escaping needed for JSON


def body_for(target: Target, max_tokens: int, stream: bool) -> dict:
    return {
        "model": target.model,
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        **target.extra_body,
    }


def wrk_cell(wrk: str, target: Target, body: dict, conc: int, duration_s: float, work: Path) -> Cell:
    """`wrk -t1 -c<conc>` for `duration_s` against the target's chat endpoint, its CPU time measured around it."""
    headers = "\n".join(f'wrk.headers["{k}"] = {_lua_str(v)}' for k, v in target.headers.items())
    script = work / f"{target.name}-{conc}-{int(body['stream'])}.lua"
    script.write_text(LUA.format(body=_lua_str(json.dumps(body)), headers=headers))
    cmd = [
        wrk,
        "-t1",
        f"-c{conc}",
        f"-d{max(1, round(duration_s))}s",
        "--timeout",
        "30s",
        "-s",
        str(script),
        target.chat_url,
    ]
    cpu0 = tree_cpu_s(target.pids)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 60)
    cpu = tree_cpu_s(target.pids) - cpu0
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed for {target.name} (exit {r.returncode}):\n{r.stdout}\n{r.stderr}")
    d = json.loads(line[6:])
    return Cell(d["requests"], d["duration_us"] / 1e6, d["p50_us"] / 1e3, d["p99_us"] / 1e3, d["errors"], cpu)


def py_cell(target: Target, body: dict, conc: int, n: int) -> Cell:
    """`n` requests from `conc` httpx connections: a stand-in for wrk in smoke runs (its numbers mean little)."""

    async def run() -> tuple[list[float], int, float]:
        lat: list[float] = []
        errors = 0
        todo = iter(range(n))
        async with httpx.AsyncClient(headers=target.headers, timeout=30) as http:

            async def conn() -> None:
                nonlocal errors
                for _ in todo:
                    t = time.perf_counter()
                    r = await http.post(target.chat_url, json=body)
                    await r.aread()
                    lat.append(time.perf_counter() - t)
                    errors += r.status_code != 200

            t0 = time.perf_counter()
            await asyncio.gather(*(conn() for _ in range(conc)))
            return lat, errors, time.perf_counter() - t0

    cpu0 = tree_cpu_s(target.pids)
    lat, errors, seconds = asyncio.run(run())
    cpu = tree_cpu_s(target.pids) - cpu0
    lat.sort()
    return Cell(len(lat), seconds, _pct(lat, 0.5) * 1e3, _pct(lat, 0.99) * 1e3, errors, cpu)


@dataclass
class StreamRun:
    """One streamed answer: time to the first content, the gaps between content events, their count."""

    ttft_s: float
    gaps_s: list[float]
    events: int


def _content(line: str) -> str:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return ""
    choices = json.loads(line[6:]).get("choices") or [{}]
    c = choices[0]
    return (c.get("delta") or {}).get("content") or c.get("text") or ""


def stream_probe(target: Target, max_tokens: int, n: int) -> list[StreamRun]:
    """`n` streamed chats one after another, timed as they arrive."""
    body = body_for(target, max_tokens, True)
    out: list[StreamRun] = []
    with httpx.Client(headers=target.headers, timeout=30) as http:
        for _ in range(n):
            for attempt in (1, 2):  # llama-server closes a connection after a stream: a kept one may be gone
                times: list[float] = []
                t0 = time.perf_counter()
                try:
                    with http.stream("POST", target.chat_url, json=body) as r:
                        r.raise_for_status()
                        for line in r.iter_lines():
                            if _content(line):
                                times.append(time.perf_counter())
                    break
                except httpx.RemoteProtocolError:
                    if attempt == 2 or times:
                        raise
            if not times:
                raise RuntimeError(f"{target.name}: a streamed answer carried no content")
            out.append(StreamRun(times[0] - t0, [b - a for a, b in zip(times, times[1:])], len(times)))
    return out


def check(target: Target, max_tokens: int) -> int:
    """One plain request that must answer 200 with content; its completion tokens (from `usage`)."""
    r = httpx.post(target.chat_url, json=body_for(target, max_tokens, False), headers=target.headers, timeout=60)
    if r.status_code != 200:
        raise RuntimeError(f"{target.name} answered {r.status_code}: {r.text[:500]}")
    d = r.json()
    if not d["choices"][0]["message"].get("content"):
        raise RuntimeError(f"{target.name} answered without content: {r.text[:500]}")
    return int((d.get("usage") or {}).get("completion_tokens") or 0)


def _pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")
