"""When nats-server must be restarted for its JetStream store to work again.

A stream whose file store hit a full disk keeps failing every write, even after the space is back: the store's
write error sticks until the server restarts (seen with nats-server 2.15; nats-io/nats-server#7654 reports the
same, or JetStream disabling itself). Until then usage events, fan-out parts and KV records are not stored.
`StoreWatch` reads the server's log for store failures and, once the store's filesystem has room again, says a
restart is due. `coderai up` acts on it; the soak (bench/soak.py), which stands in for `coderai up`, does too."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger("coderai.up")

FAILURES = (b"failed to store a msg", b"Critical write error", b"out of File resources")


class StoreWatch:
    def __init__(
        self,
        log_file: str | os.PathLike,
        store_dir: str | os.PathLike,
        min_free_bytes: int = 64 << 20,
        min_gap_s: float = 30.0,
    ) -> None:
        self.log_file = Path(log_file)
        self.store_dir = Path(store_dir)
        self.min_free_bytes = min_free_bytes
        self.min_gap_s = min_gap_s  # at most one restart this often (a disk that stays nearly full)
        self.offset = self._size()
        self.failing = False
        self.last_restart = -min_gap_s
        self.restarts = 0

    def _size(self) -> int:
        try:
            return self.log_file.stat().st_size
        except FileNotFoundError:
            return 0

    def _read_new(self) -> bytes:
        size = self._size()
        if size < self.offset:  # the log was rotated or truncated
            self.offset = 0
        if size == self.offset:
            return b""
        with open(self.log_file, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read(size - self.offset)
        self.offset = size
        return data

    def due(self) -> bool:
        """Store failures logged since the last restart, and room on the store's filesystem again."""
        data = self._read_new()
        if any(f in data for f in FAILURES):
            self.failing = True
        if not self.failing or time.monotonic() - self.last_restart < self.min_gap_s:
            return False
        try:
            free = shutil.disk_usage(self.store_dir).free
        except FileNotFoundError:
            return False
        return free >= self.min_free_bytes

    def restarted(self) -> None:
        self.failing = False
        self.last_restart = time.monotonic()
        self.restarts += 1
        self.offset = self._size()
        log.warning(
            "restarted nats-server: its JetStream store had failed writes (a full disk) and there is room "
            "again (restart %d)",
            self.restarts,
        )
