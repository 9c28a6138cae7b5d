"""The soak's figures (bench/soak.py): every outcome classified against the faults' windows, and the clients'
counts compared with Prometheus', Redis' and the event stream's once the load has stopped."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path

import httpx
from coderai.testing.procs import wait_until

from _soak_clients import EXACT_KEYS, KEYS, Outcome
from _soak_report import WINDOW_TAIL_S, match_events, prom_text_sum, read_usage, stored_events


class Figures:
    """Mixed into `Soak`: reads its ledger, faults, readings and servers."""

    def in_window(self, o: Outcome) -> bool:
        return any(o.t0 <= f.t1 + WINDOW_TAIL_S and o.t1 >= f.t0 for f in self.faults)

    def server_counts(self) -> dict:
        """Prometheus' and Redis' view, once the metrics service has read every event and been scraped since."""
        self.wait_metrics_caught_up()
        direct = prom_text_sum(
            httpx.get(f"http://127.0.0.1:{self.stack.metrics_port}/metrics", timeout=10).text, "coderai_requests_total"
        )
        wait_until(
            lambda: self.prometheus.scalar("sum(coderai_requests_total)") == direct,
            60,
            "Prometheus to scrape the final counts",
            interval_s=0.5,
        )
        requests = {
            (r["metric"].get("key", ""), r["metric"].get("model", ""), r["metric"].get("status", "")): float(
                r["value"][1]
            )
            for r in self.prometheus.query("sum by (key, model, status) (coderai_requests_total)")
        }
        tokens = {
            (r["metric"].get("key", ""), r["metric"].get("model", ""), r["metric"].get("type", "")): float(
                r["value"][1]
            )
            for r in self.prometheus.query("sum by (key, model, type) (coderai_tokens_total)")
        }
        parts = {
            r["metric"].get("status", ""): float(r["value"][1])
            for r in self.prometheus.query("sum by (status) (coderai_fanout_parts_total)")
        }
        sent = self.prometheus.scalar("sum(coderai_fanout_parts_sent_total)")
        redis_rows = read_usage(self.redis.url)
        return {"requests": requests, "tokens": tokens, "parts": parts, "parts_sent": sent, "redis": redis_rows}

    def wait_metrics_caught_up(self) -> None:
        """The metrics service's EVENTS consumer has nothing pending and nothing unacked."""

        async def pending() -> int:
            import nats

            nc = await nats.connect(self.nats.service_url, connect_timeout=5, allow_reconnect=False)
            try:
                info = await nc.jetstream().consumer_info("EVENTS", "metrics")
                return info.num_pending + info.num_ack_pending
            finally:
                await nc.close()

        wait_until(lambda: asyncio.run(pending()) == 0, 120, "the metrics service to read every event", interval_s=0.5)

    def stored_events(self) -> list[dict]:
        return stored_events(self.nats.service_url)

    def figures(self) -> dict:
        outcomes = self.ledger.snapshot()
        by_kind: dict[str, Counter] = defaultdict(Counter)
        reasons = Counter(f"{o.result}: {o.why}" for o in outcomes if o.result != "ok")
        bad_outside: list[dict] = []
        for o in outcomes:
            by_kind[o.kind][o.result] += 1
            inside = self.in_window(o)
            if o.result == "hang" or (o.result in ("bad", "refused") and not inside):
                bad_outside.append(asdict(o) | {"in_window": inside})
        answered = [o for o in outcomes if o.result == "ok" and o.key in EXACT_KEYS]
        events: list[dict] = []

        def all_stored() -> bool:  # the gateway's outbox may still be sending what it kept through a fault
            events[:] = self.stored_events()
            have = {e["cid"] for e in events if e["status"] == "ok"}
            return all(o.client_id in have for o in answered)

        with contextlib.suppress(TimeoutError):
            wait_until(all_stored, 20, "every answered request's event in the stream", interval_s=2)
        match = match_events(outcomes, events, self.in_window)
        server = self.server_counts()
        usage = []
        client_ok: Counter = Counter()
        client_tokens: Counter = Counter()
        for o in outcomes:
            if o.result == "ok":
                client_ok[(o.key, o.model)] += 1
                client_tokens[(o.key, o.model)] += o.prompt_tokens + o.completion_tokens
        for key in KEYS:
            for model in sorted(
                {m for (k, m) in client_ok if k == key} | {m for (k, m, _s) in server["requests"] if k == key}
            ):
                prom_ok = server["requests"].get((key, model, "ok"), 0.0)
                prom_all = sum(v for (k, m, _s), v in server["requests"].items() if k == key and m == model)
                row = server["redis"].get((key, model), {})
                redis_ok = row.get("requests", 0) - row.get("errors", 0)
                prom_tok = sum(v for (k, m, _t), v in server["tokens"].items() if k == key and m == model)
                redis_tok = row.get("prompt_tokens", 0) + row.get("completion_tokens", 0)
                usage.append(
                    {
                        "key": key,
                        "model": model,
                        "client_ok": client_ok[(key, model)],
                        "cut_off": match["cut_off_by_row"][(key, model)],
                        "prom_ok": prom_ok,
                        "prom_all": prom_all,
                        "redis_ok": redis_ok,
                        "redis_all": row.get("requests", 0),
                        "client_tokens": client_tokens[(key, model)],
                        "prom_tokens": prom_tok,
                        "redis_tokens": redis_tok,
                        "exact": key in EXACT_KEYS,
                    }
                )
        mismatched = [
            u
            for u in usage
            if (u["exact"] and not u["client_ok"] + u["cut_off"] == u["prom_ok"] == u["redis_ok"])
            or u["prom_all"] != u["redis_all"]
            or u["prom_tokens"] != u["redis_tokens"]
        ]
        missing_items = sum(1 for o in outcomes if o.result == "bad" and ("of 16" in o.why or "of 2 images" in o.why))
        recov = [f.recovery_s for f in self.faults if f.recovery_s is not None]
        growth = {}
        for name, (rss0, fd0) in self.readings.get("warm", {}).items():
            rss1, fd1 = self.readings.get("end", {}).get(name, (0, 0))
            growth[name] = {
                "rss_warm": rss0,
                "rss_end": rss1,
                "rss_growth": (rss1 - rss0) / rss0 if rss0 else 0.0,
                "fd_warm": fd0,
                "fd_end": fd1,
                "fd_growth": fd1 - fd0,
                "restarted": name in self.restarted,
            }
        return {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self.a).items()},
            "requests": {k: dict(c) for k, c in sorted(by_kind.items())},
            "total": len(outcomes),
            "reasons": dict(reasons.most_common(20)),
            "faults": [asdict(f) for f in self.faults],
            "store_restarts": len(self.store_restarts),
            "hangs": sum(1 for o in outcomes if o.result == "hang"),
            "bad_outside_windows": bad_outside,
            "bad_inside_windows": sum(1 for o in outcomes if o.result in ("bad", "refused") and self.in_window(o)),
            "usage": usage,
            "usage_mismatches": mismatched,
            "events": {
                "stored": len(events),
                "ok_without_id": sum(1 for o in outcomes if o.result == "ok" and not o.request_id),
                **{k: v for k, v in match.items() if k != "cut_off_by_row"},
            },
            "fanout": {
                "parts_sent": server["parts_sent"],
                "parts": server["parts"],
                "answers_missing_items": missing_items,
            },
            "recovery": {
                "p50": statistics.median(recov) if recov else None,
                "max": max(recov) if recov else None,
                "unrecovered": sum(1 for f in self.faults if f.recovery_s is None),
            },
            "processes": growth,
            "fd_changes": {
                name: {
                    "gone": sorted(set(self.fd_lists.get("warm", {}).get(name, [])) - set(fds)),
                    "new": sorted(set(fds) - set(self.fd_lists.get("warm", {}).get(name, []))),
                }
                for name, fds in self.fd_lists.get("end", {}).items()
            },
            "readings": self.readings,
        }
