from __future__ import annotations

from coderai.runtime.settings import CommonSettings


class WorkerSettings(CommonSettings, frozen=True, kw_only=True):
    """`CODERAI_WORKER_*`."""

    heartbeat_s: float = 2.0
    keepalive_s: float = 1.0  # a frame at least this often while a job is queued or prefilling
    drain_timeout_s: float = 15.0
    families: list[str] = []  # engine families to offer; empty: every one whose library is installed
