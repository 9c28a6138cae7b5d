from __future__ import annotations

from coderai.runtime.settings import CommonSettings


class SchedulerSettings(CommonSettings, frozen=True, kw_only=True):
    """`CODERAI_SCHEDULER_*`."""

    models_file: str = ""  # TOML with [[models]] tables; empty: keep whatever coderai_models holds
