from __future__ import annotations

from coderai.runtime.settings import CommonSettings


class RouterSettings(CommonSettings, frozen=True, kw_only=True):
    """`CODERAI_ROUTER_*`."""

    engine_ttl_s: float = 6.0  # a node silent this long (three missed heartbeats) gets no more requests
