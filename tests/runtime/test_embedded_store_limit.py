"""JetStream is capped at a share of its disk, so one tenant's stored responses or batches cannot fill the head's
disk for everyone (issue 40 item 5)."""

from __future__ import annotations

import os
import re

from coderai.runtime.embedded import NatsServer, store_limit


def test_the_cap_is_half_of_what_the_disk_has_for_the_store(tmp_path):
    store = tmp_path / "js"
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    assert abs(store_limit(store) - free // 2) < 64 << 20  # not made yet: its disk's
    store.mkdir()
    (store / "old").write_bytes(b"x" * (8 << 20))  # what the store holds counts as its own
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert abs(store_limit(store) - (free + (8 << 20)) // 2) < 64 << 20


def test_the_server_runs_with_the_cap(tmp_path):
    server = NatsServer(tmp_path / "nats").start(log_file=tmp_path / "nats.log")
    try:
        conf = (tmp_path / "nats" / "nats.conf").read_text()
        cap = int(re.search(r"max_file_store: (\d+)", conf).group(1))
        assert cap > 0
        log = (tmp_path / "nats.log").read_text()
        assert "Max Storage" in log, log[-2000:]
    finally:
        server.stop()
