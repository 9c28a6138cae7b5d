"""StoreWatch: a restart of nats-server is due once its log shows JetStream store failures and the store's
filesystem has room again; not before, not twice within its gap."""

from __future__ import annotations

from coderai.runtime.store_watch import StoreWatch

FAILED = (
    "[1] 2026/12/02 06:26:01.487679 [ERR] JetStream failed to store a msg on stream '$G > EVENTS': write "
    "/data/nats/jetstream/$G/streams/EVENTS/msgs/1.blk: no space left on device\n"
)


def test_a_restart_is_due_after_store_failures_once_there_is_room(tmp_path):
    log = tmp_path / "nats.log"
    log.write_text("[1] [INF] Server is ready\n")
    watch = StoreWatch(log, tmp_path, min_free_bytes=1, min_gap_s=0)
    assert not watch.due()  # nothing failed
    with open(log, "a") as fh:
        fh.write(FAILED)
    assert watch.due()
    watch.restarted()
    assert not watch.due()  # the restart healed it: no new failure since
    with open(log, "a") as fh:
        fh.write(FAILED)
    assert watch.due() and watch.restarts == 1


def test_no_restart_while_the_disk_is_still_full_or_too_soon(tmp_path):
    log = tmp_path / "nats.log"
    log.write_text(FAILED)
    full = StoreWatch(log, tmp_path, min_free_bytes=1 << 62)  # more room than any disk has
    full.offset = 0
    assert not full.due() and full.failing  # seen, but a restart now would only fail again
    soon = StoreWatch(log, tmp_path, min_free_bytes=1, min_gap_s=3600)
    soon.offset = 0
    assert soon.due()
    soon.restarted()
    with open(log, "a") as fh:
        fh.write(FAILED)
    assert not soon.due()  # within the gap after the last restart
