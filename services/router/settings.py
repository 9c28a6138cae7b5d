from __future__ import annotations

from typing import Literal

from coderai.runtime.settings import CommonSettings


class RouterSettings(CommonSettings, frozen=True, kw_only=True):
    """`CODERAI_ROUTER_*`."""

    engine_ttl_s: float = 6.0  # a node silent this long (three missed heartbeats) gets no more requests
    policy: Literal["prefix", "least_busy", "round_robin"] = "prefix"  # the last two are benchmark baselines
    guard_ratio: float = 2.0  # see picking.LoadGuard
    guard_slack: int = 4
    affinity_refresh_s: float = 60.0  # a hit older than this rewrites its entry, sliding the 30 min TTL
    # affinity keys kept in memory (~240 B each, ~23 MiB); past it the oldest go first
    affinity_max_entries: int = 100_000
