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
    return RequestCompleted(request_id=f"{secrets.token_hex(8)}-{i}", ts=time.time(), key_name="k", model="m",
                            op="chat", status="ok", http_status=200, prompt_tokens=3, completion_tokens=2)


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
