from __future__ import annotations

from coderai.runtime.settings import CommonSettings


class BrokerSettings(CommonSettings, frozen=True, kw_only=True):
    """`CODERAI_POD_BROKER_*`."""

    runpod_api_key: str = ""
    max_hourly_usd: float = 0.0  # global cap over all pods; 0 forbids renting
