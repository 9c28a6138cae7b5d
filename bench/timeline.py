"""Where one request's wall time goes in coderai, hop by hop, at concurrency 1 (issue 42: the added latency).

`bench/hotpath.py` says what each process spends in CPU under load; this says, for requests sent one at a time,
how the time a client waits splits between the hops: the gateway's HTTP server and admission, the pick, the job's
trip over NATS, the worker and its engine, the frames' trip back and the accounting, and the answer's way out. It
runs the stack of `bench/overhead.py` (API keys, metrics with Redis, JSON logs at INFO) with tracing written to
files (`CODERAI_TRACE_FILE`), sends `--requests` chats one after another on one kept connection, and joins each
answer (by its request id) with its spans:

  client sends ─▶ [http in, auth, admission] ─▶ gateway span starts ─▶ [pick] ─▶ engine.call starts
  ─▶ [job over NATS] ─▶ worker span starts ─▶ [worker and engine] ─▶ worker span ends (Final sent)
  ─▶ [frames back, accounting] ─▶ gateway span ends ─▶ [answer out] ─▶ client has the answer

Every clock is this machine's wall clock (spans and client alike). With `--model ls` the same requests go to a
bare `llama-server` replica with the same flags too, so the engine's own share of the worker's segment is known.
Tracing costs time itself (a span is written per hop): the untraced p50 of the same stack is printed beside it
(`--untraced`, a second stack), so the segments are read as shares, not as absolute costs.

  python bench/timeline.py                    # echo engine, 300 requests
  python bench/timeline.py --model ls         # tiny GGUF on llama-server, against a bare replica
  python bench/timeline.py --smoke            # seconds: 20 requests, echo
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import httpx

import _setup
from _servers import Coderai, Target, start_llama_replica
from coderai.contracts.topology import HDR_REQUEST_ID

LS_PARAMS = {"parallel": 4, "n_ctx": 512, "n_threads": 1, "n_threads_batch": 1, "cache_ram_mb": 256, "queue": 128}

SEGMENTS = (
    ("http in, auth, admission", "gateway's HTTP server, the key, the limits, the job built"),
    ("pick", "the router's pick (made in the gateway, or asked over NATS)"),
    ("job over NATS", "publish, nats-server, the worker's receipt and spawn"),
    ("worker and engine", "the worker's job: its queue, its relay, the engine's answer"),
    ("frames back, accounting", "the Final over NATS, the gateway's decode, usage, journal, log line"),
    ("answer out", "the response rendered, the HTTP server, the client's read"),
)


@dataclass
class Sent:
    """One request as the client saw it: its id and when it was sent and answered (wall clock, ns)."""

    request_id: str
    sent_ns: int
    done_ns: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["echo", "ls"], default="echo", help="echo engine, or tiny GGUF on llama-server")
    ap.add_argument("--requests", type=int, default=300, help="requests measured, one at a time (default 300)")
    ap.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request (default 16)")
    ap.add_argument("--untraced", action="store_true", help="also time the same requests on a stack without tracing")
    ap.add_argument("--json", type=Path, help="also write every request's segments here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (spans, logs)")
    ap.add_argument("--smoke", action="store_true", help="20 requests; seconds")
    a = ap.parse_args(argv)
    if a.smoke:
        a.requests = 20
    return a


def body(target: Target, max_tokens: int) -> dict:
    return {
        "model": target.model,
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def send(target: Target, n: int, max_tokens: int, warm: int = 20) -> list[Sent]:
    """`n` chats one after another on one kept connection (after `warm` unmeasured ones)."""
    out: list[Sent] = []
    payload = json.dumps(body(target, max_tokens)).encode()
    headers = {**target.headers, "Content-Type": "application/json"}
    with httpx.Client(timeout=30) as http:
        for i in range(warm + n):
            t0 = time.time_ns()
            r = http.post(target.chat_url, content=payload, headers=headers)
            t1 = time.time_ns()
            r.raise_for_status()
            if i >= warm:
                out.append(Sent(r.headers.get(HDR_REQUEST_ID, ""), t0, t1))
    return out


def read_spans(folder: Path) -> list[dict]:
    spans = []
    for f in sorted(folder.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                spans.append(json.loads(line))
    return spans


def segments(sent: list[Sent], spans: list[dict]) -> list[dict[str, float]]:
    """Each request's segments in ms, from its spans: the gateway's request span (by request id), its engine call
    and pick (children of it), and the worker's job span (by request id). Requests whose spans are not all there
    (a span file cut short) are left out."""
    by_trace: dict[str, list[dict]] = defaultdict(list)
    for s in spans:
        by_trace[s["trace_id"]].append(s)
    roots = {
        s["attributes"].get("coderai.request_id"): s
        for s in spans
        if s["service"] == "gateway" and s["parent_id"] is None and s["attributes"].get("coderai.request_id")
    }
    out = []
    for r in sent:
        root = roots.get(r.request_id)
        if root is None:
            continue
        family = by_trace[root["trace_id"]]
        call = next((s for s in family if s["name"] == "engine.call" and s["parent_id"] == root["span_id"]), None)
        job = next((s for s in family if s["service"] != "gateway" and s["name"].startswith("engine.")), None)
        if call is None or job is None:
            continue
        ms = 1e-6
        out.append(
            {
                "http in, auth, admission": (root["start_ns"] - r.sent_ns) * ms,
                "pick": (call["start_ns"] - root["start_ns"]) * ms,
                "job over NATS": (job["start_ns"] - call["start_ns"]) * ms,
                "worker and engine": (job["end_ns"] - job["start_ns"]) * ms,
                "frames back, accounting": (root["end_ns"] - job["end_ns"]) * ms,
                "answer out": (r.done_ns - root["end_ns"]) * ms,
                "total": (r.done_ns - r.sent_ns) * ms,
            }
        )
    return out


def p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def latencies(sent: list[Sent]) -> list[float]:
    return [(s.done_ns - s.sent_ns) / 1e6 for s in sent]


def table(rows: list[dict[str, float]], bare_p50: float | None, untraced_p50: float | None) -> str:
    lines = [
        "| segment | p50 ms | p90 ms | share of the p50s | what it is |",
        "|---|---:|---:|---:|---|",
    ]
    p50s = {name: statistics.median([r[name] for r in rows]) for name, _ in SEGMENTS}
    whole = sum(p50s.values()) or 1.0
    for name, what in SEGMENTS:
        xs = [r[name] for r in rows]
        lines.append(f"| {name} | {p50s[name]:.3f} | {p(xs, 0.9):.3f} | {100 * p50s[name] / whole:.0f} % | {what} |")
    total = [r["total"] for r in rows]
    lines.append(f"| **client's total** | **{statistics.median(total):.3f}** | {p(total, 0.9):.3f} | | |")
    if untraced_p50 is not None:
        lines.append(f"| the same stack untraced | {untraced_p50:.3f} | | | tracing's own cost is the difference |")
    if bare_p50 is not None:
        engine = p50s["worker and engine"]
        lines.append(f"| bare `llama-server`, asked directly | {bare_p50:.3f} | | | the engine with its own HTTP |")
        lines.append(
            f"| worker's share of its segment | {engine - bare_p50:.3f} | | | worker and engine, less the bare answer |"
        )
    return "\n".join(lines)


def start_stack(work: Path, model: str, traced: bool) -> tuple[Coderai, Target]:
    env = {"CODERAI_TRACE_FILE": str(work / "spans" / "{service}.jsonl")} if traced else {}
    coderai = Coderai(work, extra_env=env)
    if model == "echo":
        coderai.start(None, 1, 512, 1)
        return coderai, coderai.target("coderai", "echo")
    from coderai.tiny_models.llm import build_tiny_gguf

    gguf = Path(build_tiny_gguf(work / "tiny.gguf")["out"])
    coderai.start(None, 1, 512, 1, ls_params=LS_PARAMS, ls_gguf=gguf)
    return coderai, coderai.target("coderai", "tiny-ls")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="coderai-timeline-"))
    out: dict = {"args": sys.argv[1:]}
    bare_p50 = untraced_p50 = None
    load_before = os.getloadavg()[0]
    try:
        coderai, target = start_stack(work, a.model, traced=True)
        try:
            sent = send(target, a.requests, a.max_tokens)
        finally:
            coderai.stop()  # every span is written by now (one synchronous write per span)
        rows = segments(sent, read_spans(work / "spans"))
        if not rows:
            print(f"no request could be joined with its spans (work dir {work})", file=sys.stderr)
            a.keep = True
            return 1
        if a.untraced:
            plain, plain_target = start_stack(work / "untraced", a.model, traced=False)
            try:
                untraced_p50 = statistics.median(latencies(send(plain_target, a.requests, a.max_tokens)))
            finally:
                plain.stop()
        if a.model == "ls":
            from coderai.runtime.embedded import find_llama_server

            gguf = work / "tiny.gguf"
            proc, bare = start_llama_replica(work, find_llama_server(), gguf, "ls-bare", 1, 4, 512, 256)
            try:
                bare_p50 = statistics.median(latencies(send(bare, a.requests, a.max_tokens)))
            finally:
                proc.stop()
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"# Where one request's time goes: {target.model}, one request at a time\n")
    print(
        f"{len(rows)} of {len(sent)} requests joined with their spans; max_tokens {a.max_tokens}; load average "
        f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after\n"
    )
    print(table(rows, bare_p50, untraced_p50))
    print()
    out.update(rows=rows, bare_p50_ms=bare_p50, untraced_p50_ms=untraced_p50)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    if a.keep:
        print(f"work dir (spans, logs): {work}")
    return 0


if __name__ == "__main__":
    _setup.run_main(main, "timeline")
