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
    rps_low: float = 0.0  # the slowest round's requests/s
    rps_high: float = 0.0  # the fastest round's

    @property
    def spread(self) -> str:
        """How far the rounds were apart: the fastest round's req/s over the slowest's, as a percentage."""
        return f"±{50 * (self.rps_high - self.rps_low) / self.rps:.0f}%" if self.rps else "n/a"


def aggregate(cells: list[Cell]) -> Agg:
    """Rounds of one cell together: the median round's requests/s and latency percentiles, CPU per request over
    all of them, and the rounds' spread."""
    req = sum(c.requests for c in cells)
    rates = [c.requests / c.seconds for c in cells if c.seconds]
    return Agg(
        req,
        statistics.median(rates) if rates else 0.0,
        statistics.median(c.p50_ms for c in cells),
        statistics.median(c.p99_ms for c in cells),
        1e3 * sum(c.cpu_s for c in cells) / req if req else float("nan"),
        sum(c.errors for c in cells),
        min(rates, default=0.0),
        max(rates, default=0.0),
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
        "| path | conc | stream | p50 ms | p99 ms | req/s | spread | p50 vs base | +p50 ms | req/s vs base | CPU ms/req "
        "| errors |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cells = sorted({(c, s) for _, c, s in rows}, key=lambda cs: (cs[1], cs[0]))
    for conc, stream in cells:
        base = rows.get((baseline, conc, stream))
        for name in order:
            a = rows.get((name, conc, stream))
            if a is None:
                continue
            out.append(
                f"| {name} | {conc} | {'yes' if stream else 'no'} | {a.p50_ms:.2f} | {a.p99_ms:.2f} | {a.rps:,.0f} | {a.spread} | "
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


def targets(pure: dict, routers: dict, router_probes: dict[str, Probe]) -> list[str]:
    """The hot path's targets (issue 42), each with what this run measured (only those it has data for)."""
    lines: list[str] = []

    def line(ok: bool, text: str) -> None:
        lines.append(f"- [{'x' if ok else ' '}] {text}")

    bare1, ours1, vllm1 = (routers.get((n, 1, False)) for n in ("ls-bare", "coderai-ls", "vllm-router"))
    if bare1 and ours1 and vllm1:
        ours, theirs = ours1.p50_ms - bare1.p50_ms, vllm1.p50_ms - bare1.p50_ms
        line(
            ours <= theirs + 0.5, f"c=1: coderai adds {ours:+.2f} ms p50, vllm-router {theirs:+.2f} ms (within 0.5 ms)"
        )
    if bare1 and ours1:
        added = ours1.cpu_ms - bare1.cpu_ms
        line(added <= 1.0, f"c=1: coderai adds {added:.2f} ms of CPU per request to the replica's (at most 1 ms)")
    for conc in (8, 64):
        for stream in (False, True):
            ours, vllm = routers.get(("coderai-ls", conc, stream)), routers.get(("vllm-router", conc, stream))
            if ours and vllm:
                line(
                    ours.rps >= vllm.rps,
                    f"c={conc}{' streamed' if stream else ''}: coderai {ours.rps:,.0f} req/s, vllm-router "
                    f"{vllm.rps:,.0f} (at least as many)",
                )
    pb, pc = router_probes.get("ls-bare"), router_probes.get("coderai-ls")
    if pb and pc:
        line(
            pc.ttft_ms <= 1.2 * pb.ttft_ms,
            f"streamed, c=1: time to first token {pc.ttft_ms / pb.ttft_ms:.2f}x the bare replica's (at most 1.2x)",
        )
    c1, c64, l64 = pure.get(("coderai", 1, False)), pure.get(("coderai", 64, False)), pure.get(("litellm", 64, False))
    if c64:
        line(c64.rps >= 3500, f"pure, c=64: {c64.rps:,.0f} req/s (at least 3,500)")
    if c1:
        line(c1.p50_ms <= 1.0, f"pure, c=1: p50 {c1.p50_ms:.2f} ms (at most 1.0 ms)")
    if c64 and l64:
        line(c64.rps >= 15 * l64.rps, f"pure, c=64: {c64.rps / l64.rps:.0f}x LiteLLM's req/s (at least 15x)")
    return lines
