"""The soak's figures read back and printed (bench/soak.py): its targets, its markdown table, a real Prometheus
queried through its HTTP API, and Redis usage."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict
from typing import Any


WINDOW_TAIL_S = 5.0  # a fault's window ends this long after the fault does: the recovery target


def targets(fig: dict) -> list[tuple[str, bool, str]]:
    """(target, met, what was measured)."""
    kinds = {f["kind"] for f in fig["faults"]}
    want = set(fig["args"]["faults"])
    grown = {n: g for n, g in fig["processes"].items() if not g["restarted"]}
    rss_bad = {n: f"{g['rss_growth']:+.1%}" for n, g in grown.items() if g["rss_growth"] >= 0.10}
    fd_bad = {n: g["fd_growth"] for n, g in grown.items() if g["fd_growth"] > 0}
    slow = [
        f"{f['kind']} {f['recovery_s']:.1f}s" if f["recovery_s"] is not None else f"{f['kind']} never"
        for f in fig["faults"]
        if f["recovery_s"] is None or f["recovery_s"] > WINDOW_TAIL_S
    ]
    return [
        ("every fault kind injected", want <= kinds, ", ".join(sorted(kinds))),
        ("0 hangs", fig["hangs"] == 0, str(fig["hangs"])),
        (
            "0 bad outcomes outside a fault's window",
            not fig["bad_outside_windows"],
            str(len(fig["bad_outside_windows"])),
        ),
        ("0 lost or double-counted usage records", usage_exact(fig), usage_measured(fig)),
        (
            "0 lost fan-out parts",
            fig["fanout"]["answers_missing_items"] == 0,
            str(fig["fanout"]["answers_missing_items"]),
        ),
        ("recovery within 5 s of each fault's end", not slow, "; ".join(slow) or f"max {fig['recovery']['max']:.2f}s"),
        (
            "RSS growth under 10 % after warm-up",
            not rss_bad,
            ", ".join(f"{n} {v}" for n, v in rss_bad.items()) or "all under",
        ),
        ("fd growth 0 after warm-up", not fd_bad, ", ".join(f"{n} +{v}" for n, v in fd_bad.items()) or "none"),
    ]


def match_events(outcomes: list, events: list[dict], in_window: Callable[[Any], bool]) -> dict:
    """Every usage event matched to the client request it bills, by the client's own id (X-Client-Request-Id),
    which the client knows even when no answer came. For the keys whose answers are whole (EXACT_KEYS):

    - lost: a request the client saw answered ok, with no ok event;
    - twice: an event stored twice, or two ok events for one client request;
    - unknown: an ok event for a request no client sent;
    - cut off: an ok event for a request whose answer broke on its way to the client (the server finished and
      billed it, as OpenAI bills a response its client never read). Allowed only inside a fault's window and where
      the client saw the connection break; an error answer (4xx, 503) that was billed as ok is a miscount."""
    from _soak_clients import EXACT_KEYS

    exact = [o for o in outcomes if o.key in EXACT_KEYS]
    sent = {o.client_id: o for o in exact}
    ok_events = [e for e in events if e["status"] == "ok" and e["key"] in EXACT_KEYS]
    ok_cids = Counter(e["cid"] for e in ok_events)
    lost = [asdict(o) for o in exact if o.result == "ok" and o.client_id not in ok_cids]
    stored_twice = sum(1 for n in Counter(e["id"] for e in events).values() if n > 1)
    billed_twice = sum(1 for cid, n in ok_cids.items() if cid and n > 1)
    cut_off = [o for o in exact if o.result != "ok" and o.client_id in ok_cids]
    miscounted = [asdict(o) for o in cut_off if o.result == "clean" or not in_window(o)]
    return {
        "lost": lost[:50],
        "lost_count": len(lost),
        "twice": stored_twice + billed_twice,
        "unknown": sum(1 for e in ok_events if e["cid"] not in sent),
        "cut_off": len(cut_off),
        "cut_off_by_row": Counter((o.key, o.model) for o in cut_off),
        "cut_off_why": dict(Counter(f"{o.result}: {o.why}" for o in cut_off).most_common(5)),
        "miscounted": miscounted[:20],
        "miscounted_count": len(miscounted),
    }


def usage_exact(fig: dict) -> bool:
    ev = fig["events"]
    return not (fig["usage_mismatches"] or ev["lost_count"] or ev["twice"] or ev["unknown"] or ev["miscounted_count"])


def usage_measured(fig: dict) -> str:
    ev = fig["events"]
    return (
        f"{ev['lost_count']} answered requests without an ok event, {ev['twice']} events stored or billed twice, "
        f"{ev['unknown']} ok events no client sent, {ev['miscounted_count']} error answers billed as ok, "
        f"{len(fig['usage_mismatches'])} (key, model) rows where the counts differ; {ev['cut_off']} finished "
        "and billed, then cut off in transit inside a fault's window"
    )


def table(fig: dict, command: str, seconds: float) -> str:
    out = [f"Command: `{command}` ({seconds / 60:.1f} min in all, {os.cpu_count()} CPUs).", ""]
    results = ("ok", "clean", "bad", "refused", "hang")
    out += ["| requests | " + " | ".join(results) + " | total |", "|---|" + "---:|" * (len(results) + 1)]
    for kind, c in fig["requests"].items():
        out.append(f"| {kind} | " + " | ".join(str(c.get(r, 0)) for r in results) + f" | {sum(c.values())} |")
    out += ["", "| fault | target | times | recovery p50 | recovery max |", "|---|---|---:|---:|---:|"]
    per: dict[tuple[str, str], list] = defaultdict(list)
    for f in fig["faults"]:
        per[(f["kind"], f["target"])].append(f["recovery_s"])
    for (kind, target), rs in sorted(per.items()):
        ok = [r for r in rs if r is not None]
        p50 = f"{statistics.median(ok):.2f} s" if ok else "never"
        mx = f"{max(ok):.2f} s" if ok else "never"
        out.append(
            f"| {kind} | {target} | {len(rs)} | {p50} | {mx}{' (' + str(len(rs) - len(ok)) + ' never)' if len(ok) < len(rs) else ''} |"
        )
    out += [
        "",
        "| usage (key, model) | client ok | cut off | Prometheus ok | Redis ok | Prometheus all | Redis all | "
        "client tokens | Prometheus tokens | Redis tokens |",
        "|---|" + "---:|" * 9,
    ]
    for u in fig["usage"]:
        out.append(
            f"| {u['key']} {u['model']}{'' if u['exact'] else ' (rude)'} | {u['client_ok']} | "
            f"{u['cut_off']} | {u['prom_ok']:.0f} | "
            f"{u['redis_ok']} | {u['prom_all']:.0f} | {u['redis_all']} | {u['client_tokens']} | "
            f"{u['prom_tokens']:.0f} | {u['redis_tokens']} |"
        )
    if fig["reasons"]:
        out += [
            "",
            "Why requests were not ok (most common first): "
            + "; ".join(f"{why} x{n}" for why, n in fig["reasons"].items())
            + ".",
        ]
    fan = fig["fanout"]
    out += [
        "",
        f"Fan-out: {fan['parts_sent']:g} parts sent; finished by status {fan['parts']}; "
        f"{fan['answers_missing_items']} answers missing items.",
        "",
    ]
    out += [
        "| process | RSS after warm-up | RSS at end | growth | fds after warm-up | fds at end |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, g in sorted(fig["processes"].items()):
        note = " (restarted)" if g["restarted"] else ""
        out.append(
            f"| {name}{note} | {g['rss_warm'] / 2**20:.0f} MiB | {g['rss_end'] / 2**20:.0f} MiB | "
            f"{g['rss_growth']:+.1%} | {g['fd_warm']} | {g['fd_end']} |"
        )
    out += ["", "| target | met | measured |", "|---|---|---|"]
    for name, met, what in targets(fig):
        out.append(f"| {name} | {'yes' if met else '**no**'} | {what} |")
    if fig["bad_outside_windows"]:
        out += ["", "Bad outcomes outside a fault's window (first 10):", ""]
        out += [f"- {b['kind']} {b['result']}: {b['why']}" for b in fig["bad_outside_windows"][:10]]
    return "\n".join(out) + "\n"


# --- Prometheus and Redis ---------------------------------------------------------------------------------------


def prom_text_sum(text: str, name: str) -> float:
    """The sum of every sample of `name` in a Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def read_usage(url: str) -> dict[tuple[str, str], dict[str, int]]:
    """Today's (and yesterday's, for a run across midnight) usage hashes: (key, model) -> field -> sum."""
    import redis

    from coderai.accounts.usage import day_of, usage_key

    r = redis.Redis.from_url(url)
    out: dict[tuple[str, str], dict[str, int]] = defaultdict(Counter)
    try:
        now = time.time()
        for day in sorted({day_of(now - 86400), day_of(now)}):
            for member in r.smembers(f"coderai:usage:index:{day}"):
                key, model = member.decode().split("\t", 1)
                for f, v in r.hgetall(usage_key(day, key, model)).items():
                    out[(key, model)][f.decode()] += int(v)
    finally:
        r.close()
    return out


def stored_events(nats_url: str) -> list[dict]:
    """Every request.completed the EVENTS stream holds: what usage and Prometheus were built from."""
    from coderai.testing.events import read_completed

    return [
        {"id": e.request_id, "cid": e.client_request_id, "key": e.key_name, "model": e.model, "status": e.status}
        for e in asyncio.run(read_completed(nats_url))
    ]
