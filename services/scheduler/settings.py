from __future__ import annotations

from coderai.runtime.settings import CommonSettings


class SchedulerSettings(CommonSettings, frozen=True, kw_only=True):
    """`CODERAI_SCHEDULER_*`."""

    models_file: str = ""  # TOML with [[models]] tables; empty: keep whatever coderai_models holds
    # membership (services/scheduler/membership.py): the registry of NATS users, the users file nats-server reads
    # (-c) and its pid file; `coderai up` sets all three; without them nobody can join or be revoked
    members_file: str = ""
    nats_users_file: str = ""
    nats_pid_file: str = ""
