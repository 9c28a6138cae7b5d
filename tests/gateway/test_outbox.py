"""The gateway's request.completed outbox over a nats-server of its own, killed and started again: events made
while NATS is down reach the EVENTS stream once it is back, and an event sent twice is stored once."""

from __future__ import annotations

import secrets
import time

import pytest

from coderai.contracts import RequestCompleted
from coderai.contracts.topology import EVENTS
from coderai.gateway.outbox import Outbox
from coderai.runtime.bus import Bus
from coderai.runtime.embedded import NatsServer, free_port
from coderai.runtime.lifecycle import wait_for


def done(i: int) -> RequestCompleted:
    return RequestCompleted(
        request_id=f"{secrets.token_hex(8)}-{i}",
        ts=time.time(),
        key_name="k",
        model="m",
        op="chat",
        status="ok",
        http_status=200,
        prompt_tokens=3,
        completion_tokens=2,
    )


@pytest.fixture
def own_nats(tmp_path):
    server = NatsServer(tmp_path / "nats", port=free_port()).start()  # a fixed port, so it comes back there
    yield server
    server.stop()


async def stored(bus: Bus) -> int:
    return (await bus.js.stream_info(EVENTS.name)).state.messages


async def test_events_made_during_an_outage_are_stored_once_it_ends(own_nats, tmp_path):
    bus = await Bus.connect(own_nats.url, "test-gateway")
    await bus.ensure_stream(EVENTS)
    box = Outbox(bus)
    box.start()
    try:
        for i in range(5):
            box.put(done(i))
        await wait_for(lambda: not box.queue, 10, what="the first events acked")
        assert await stored(bus) == 5

        own_nats.kill()
        await wait_for(lambda: not bus.connected, 10, what="the bus to see NATS gone")
        for i in range(5, 25):
            box.put(done(i))
        own_nats.start()
        await wait_for(lambda: bus.connected and not box.queue, 20, what="the outbox to empty after NATS is back")
        assert await stored(bus) == 25  # none lost, none twice
    finally:
        await box.close()
        await bus.close()


async def test_an_event_sent_twice_is_stored_once(own_nats):
    bus = await Bus.connect(own_nats.url, "test-gateway")
    await bus.ensure_stream(EVENTS)
    box = Outbox(bus)
    try:
        e = done(0)
        await box._send(e)
        await box._send(e)  # its first ack lost: the outbox sends it again, with the same Nats-Msg-Id
        assert await stored(bus) == 1
    finally:
        await bus.close()


async def test_close_sends_what_is_waiting(own_nats):
    bus = await Bus.connect(own_nats.url, "test-gateway")
    await bus.ensure_stream(EVENTS)
    box = Outbox(bus)
    box.start()
    for i in range(100):
        box.put(done(i))
    await box.close()  # a gateway stopping: the last answers' events go out before the bus drains
    try:
        assert not box.queue and await stored(bus) == 100
    finally:
        await bus.close()


JOURNALLING = """
import sys, time
from pathlib import Path
from coderai.contracts import RequestCompleted
from coderai.gateway.outbox import JOURNAL_KEY, Journal
from coderai.runtime.members import ensure_secret

folder = Path(sys.argv[1])
journal = Journal(folder, ensure_secret(folder.parent / "secrets" / JOURNAL_KEY).encode())
for rid in sys.argv[2].split(","):
    journal.event(RequestCompleted(request_id=rid, ts=time.time(), key_name="k", model="m", op="chat", status="ok",
                                   http_status=200, prompt_tokens=3, completion_tokens=2))
journal.acked([r for r in sys.argv[3].split(",") if r])
print(journal.path, flush=True)
sys.stdin.read()  # until killed (or its parent goes)
"""


def journalling(folder, events: list[RequestCompleted], acked: list[RequestCompleted]):
    """A process journalling `events` as a gateway's outbox does, `acked` of them acked, then waiting to be
    killed; (the process, its journal's path)."""
    import subprocess
    import sys
    from pathlib import Path

    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            JOURNALLING,
            str(folder),
            ",".join(e.request_id for e in events),
            ",".join(e.request_id for e in acked),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return p, Path(p.stdout.readline().strip())


async def replaying(bus, folder) -> tuple[list[str], Outbox]:
    """A gateway's outbox started on `folder` (it takes over the journals of dead processes), and the request ids
    of the events it sends, as they reach the stream's subject."""
    from coderai.contracts import decode
    from coderai.contracts.subjects import EVT_REQUEST_COMPLETED

    await bus.ensure_stream(EVENTS)
    seen: list[str] = []

    async def on_event(m) -> None:
        seen.append(decode(m.data, RequestCompleted).request_id)

    await bus.nc.subscribe(EVT_REQUEST_COMPLETED(), cb=on_event)
    box = Outbox(bus, journal_dir=folder)
    box.start()
    return seen, box


async def test_a_killed_gateways_unacked_events_are_sent_by_the_next_one(own_nats, tmp_path):
    """A gateway SIGKILLed with events not yet acked (its answers already sent) leaves them in its journal: the
    next gateway to start on that data dir sends those, and only those; a live gateway's journal is left alone."""
    import signal

    folder = tmp_path / "gateway-outbox"
    dead = [done(i) for i in range(4)]
    killed, killed_path = journalling(folder, dead, acked=dead[:2])  # two acked before the kill
    alive, alive_path = journalling(folder, [done(9)], acked=[])
    bus = await Bus.connect(own_nats.url, "test-gateway")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        seen, box = await replaying(bus, folder)
        await wait_for(lambda: len(seen) >= 2 and not box.queue, 10, what="the dead gateway's events sent")
        assert sorted(seen) == sorted(e.request_id for e in dead[2:])
        assert await stored(bus) == 2
        assert not killed_path.exists() and alive_path.exists()
        await wait_for(lambda: box.journal.size() == 0, 10, what="this outbox's journal emptied once all is acked")
        mine = box.journal.path
        await box.close()
        assert not mine.exists() and alive_path.exists()
    finally:
        alive.kill()
        alive.wait()
        await bus.close()


async def test_a_line_forged_into_the_journal_folder_is_never_replayed(own_nats, tmp_path, caplog):
    """Attack: whoever can write into `<data>/gateway-outbox/` drops a journal there (or appends to a dead
    gateway's) with a `cost_usd: -50` event, to lower a key's spend at the next start. Only lines signed with the
    head's journal key are replayed."""
    import signal

    from coderai.contracts import encode

    folder = tmp_path / "gateway-outbox"
    real = done(1)
    killed, killed_path = journalling(folder, [real], acked=[])
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    forged = RequestCompleted(
        request_id="forged-1",
        ts=0.0,
        key_name="victim",
        model="m",
        op="chat",
        status="ok",
        http_status=200,
        prompt_tokens=1,
        completion_tokens=1,
        cost_usd=-50.0,
    )
    with open(killed_path, "ab") as fh:  # appended to a real journal: unsigned, and signed with a guessed key
        fh.write(b"E" + encode(forged) + b"\n")
        fh.write(b"0" * 64 + b" E" + encode(forged) + b"\n")
    (folder / "outbox-1-deadbeef.jsonl").write_bytes(b"E" + encode(forged) + b"\n")  # a journal of its own
    bus = await Bus.connect(own_nats.url, "test-gateway")
    try:
        seen, box = await replaying(bus, folder)
        await wait_for(lambda: seen and not box.queue, 10, what="the dead gateway's real event sent")
        await box.close()
        assert seen == [real.request_id], seen
        assert "MAC does not verify" in caplog.text
        print(f"forged journal lines (cost_usd -50): 3 written, {seen.count('forged-1')} replayed")
    finally:
        await bus.close()
