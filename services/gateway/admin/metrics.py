"""`GET /metrics`: the metrics service's Prometheus text, for an admin key or the scrape token."""

from __future__ import annotations

import asyncio
import urllib.request

from litestar import Response, get

from coderai.gateway.auth import scrape_guard
from coderai.gateway.errors import ApiError
from coderai.gateway.state import GatewayController


class MetricsController(GatewayController):
    before_request = scrape_guard

    @get("/metrics")
    async def metrics(self) -> Response:
        url, token = self.gw.settings.metrics_url, self.gw.settings.scrape_token
        if not url:
            raise ApiError(404, "No metrics service is configured (CODERAI_GATEWAY_METRICS_URL).", code="no_metrics")

        def fetch() -> bytes:
            req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.read()

        try:
            text = await asyncio.to_thread(fetch)
        except OSError as exc:
            raise ApiError(
                502, f"The metrics service did not answer: {exc}", type="engine_error", code="metrics_unavailable"
            ) from None
        return Response(content=text, media_type="text/plain; version=0.0.4; charset=utf-8")
