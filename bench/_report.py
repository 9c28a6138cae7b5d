"""Markdown tables for the overhead bench: every number also as a ratio to the part's baseline from the same run."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from _load import Cell, StreamRun


@dataclass
class Agg:
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_ms: float  # server CPU per request, all of the path's processes together
    errors: int


def aggregate(cells: list[Cell]) -> Agg:
    """Rounds of one cell together: requests/s over all their time, latency percentiles averaged over rounds."""
    req = sum(c.requests for c in cells)
    secs = sum(c.seconds for c in cells)
    return Agg(
        req,
        req / secs if secs else 0.0,
        statistics.fmean(c.p50_ms for c in cells),
        statistics.fmean(c.p99_ms for c in cells),
        1e3 * sum(c.cpu_s for c in cells) / req if req else float("nan"),
        sum(c.errors for c in cells),
    )


@dataclass
class Probe:
    ttft_ms: float  # median time to the first content
    gap_ms: float  # mean gap between content events
    events: float  # content events per answer


def summarize(runs: list[StreamRun]) -> Probe:
    gaps = [g for r in runs for g in r.gaps_s]
    return Probe(
        1e3 * statistics.median(r.ttft_s for r in runs),
        1e3 * statistics.fmean(gaps) if gaps else float("nan"),
        statistics.fmean(r.events for r in runs),
    )


def _x(v: float, base: float | None) -> str:
    return f"{v / base:.2f}x" if base else "n/a"


def _plus(v: float, base: float | None) -> str:
    return f"{v - base:+.2f}" if base is not None else "n/a"


def load_table(rows: dict[tuple[str, int, bool], Agg], order: list[str], baseline: str) -> str:
    """One row per path, concurrency and streaming; ratios against `baseline` at the same concurrency."""
    out = [
        "| path | conc | stream | p50 ms | p99 ms | req/s | p50 vs base | +p50 ms | req/s vs base | CPU ms/req | errors |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cells = sorted({(c, s) for _, c, s in rows}, key=lambda cs: (cs[1], cs[0]))
    for conc, stream in cells:
        base = rows.get((baseline, conc, stream))
        for name in order:
            a = rows.get((name, conc, stream))
            if a is None:
                continue
            out.append(
                f"| {name} | {conc} | {'yes' if stream else 'no'} | {a.p50_ms:.2f} | {a.p99_ms:.2f} | {a.rps:,.0f} | "
                f"{_x(a.p50_ms, base and base.p50_ms)} | {_plus(a.p50_ms, base and base.p50_ms)} | "
                f"{_x(a.rps, base and base.rps)} | {a.cpu_ms:.2f} | {a.errors} |"
            )
    return "\n".join(out)


def probe_table(probes: dict[str, Probe], tokens: dict[str, int], order: list[str], baseline: str) -> str:
    """Streaming at concurrency 1: time to first token and the mean gap between tokens."""
    base = probes.get(baseline)
    out = [
        "| path | TTFT p50 ms | TTFT vs base | mean gap ms | gap vs base | +gap ms | chunks/answer | usage tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in order:
        p = probes.get(name)
        if p is None:
            continue
        out.append(
            f"| {name} | {p.ttft_ms:.2f} | {_x(p.ttft_ms, base and base.ttft_ms)} | {p.gap_ms:.3f} | "
            f"{_x(p.gap_ms, base and base.gap_ms)} | {_plus(p.gap_ms, base and base.gap_ms)} | {p.events:.1f} | "
            f"{tokens.get(name, 0)} |"
        )
    return "\n".join(out)


def acceptance(real: dict, pure: dict, real_probes: dict[str, Probe]) -> list[str]:
    """Issue 14's targets, each with what this run measured (only those the run has data for)."""
    lines: list[str] = []

    def line(ok: bool, text: str) -> None:
        lines.append(f"- [{'x' if ok else ' '}] {text}")

    c1, l1 = pure.get(("coderai", 1, False)), pure.get(("litellm", 1, False))
    if c1:
        line(
            c1.p50_ms <= 1.5 and (not l1 or c1.p50_ms * 4.5 <= l1.p50_ms),
            f"pure, conc 1: p50 {c1.p50_ms:.2f} ms (target <= 1.5 ms and 4.5x under LiteLLM"
            + (f"'s {l1.p50_ms:.2f} ms)" if l1 else ")"),
        )
    c64, l64 = pure.get(("coderai", 64, False)), pure.get(("litellm", 64, False))
    if c64:
        line(
            c64.rps >= 3000 and (not l64 or c64.rps >= 20 * l64.rps),
            f"pure, conc 64: {c64.rps:,.0f} req/s (target >= 3,000 and 20x LiteLLM"
            + (f"'s {l64.rps:,.0f})" if l64 else ")"),
        )
    r1, b1 = real.get(("coderai", 1, False)), real.get(("bare", 1, False))
    if r1 and b1:
        line(
            r1.p50_ms - b1.p50_ms <= 1.5,
            f"real, conc 1: coderai adds {r1.p50_ms - b1.p50_ms:+.2f} ms p50 (target <= 1.5 ms)",
        )
    r64, b64 = real.get(("coderai", 64, False)), real.get(("bare", 64, False))
    if r64 and b64:
        line(
            r64.rps >= 0.9 * b64.rps,
            f"real, conc 64: coderai keeps {100 * r64.rps / b64.rps:.0f} % of the bare engine's req/s (target >= 90 %)",
        )
    pc, pb = real_probes.get("coderai"), real_probes.get("bare")
    if pc and pb:
        line(
            abs(pc.gap_ms - pb.gap_ms) <= 0.2,
            f"real, streaming: inter-token gap {pc.gap_ms - pb.gap_ms:+.3f} ms "
            "against the bare engine (target within 0.2 ms)",
        )
    return lines


def router_targets(rows: dict) -> list[str]:
    """Issue 20's router targets: coderai's added p50 at 1 within 0.5 ms of the best Rust router's, its req/s at
    64 at least the best Rust router's (non-streamed), each with what this run measured."""
    lines: list[str] = []
    rust = ("sglang-rr", "sglang-ca", "vllm-router")
    base1, ours1 = rows.get(("ls-bare", 1, False)), rows.get(("coderai-ls", 1, False))
    best1 = min((rows[(r, 1, False)] for r in rust if (r, 1, False) in rows), key=lambda x: x.p50_ms, default=None)
    if base1 and ours1 and best1:
        ours, theirs = ours1.p50_ms - base1.p50_ms, best1.p50_ms - base1.p50_ms
        lines.append(
            f"- [{'x' if ours <= theirs + 0.5 else ' '}] conc 1: coderai adds {ours:+.2f} ms p50, the best "
            f"Rust router {theirs:+.2f} ms (target: within 0.5 ms)"
        )
    ours64 = rows.get(("coderai-ls", 64, False))
    best64 = max((rows[(r, 64, False)] for r in rust if (r, 64, False) in rows), key=lambda x: x.rps, default=None)
    if ours64 and best64:
        lines.append(
            f"- [{'x' if ours64.rps >= best64.rps else ' '}] conc 64: coderai {ours64.rps:,.0f} req/s, the "
            f"best Rust router {best64.rps:,.0f} (target: at least as many)"
        )
    return lines
