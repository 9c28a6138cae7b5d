from __future__ import annotations

from coderai.runtime.settings import CommonSettings


class MetricsSettings(CommonSettings, frozen=True, kw_only=True):
    """`CODERAI_METRICS_*`."""

    host: str = "127.0.0.1"
    port: int = 9464
    redis_url: str = ""  # per-key usage counters; empty: Prometheus only
    consumer: str = "metrics"  # durable consumer name on EVENTS
    batch_linger_s: float = 0.05  # after a short batch, let events gather this long before the next fetch
    scrape_token: str = ""  # when set, /metrics needs `Authorization: Bearer <token>`
