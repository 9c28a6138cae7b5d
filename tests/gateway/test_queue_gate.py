"""The gate that sends a request whole to one engine while its `WORK` queue takes no parts (a RAFT group electing
a leader after a nats-server died): closed by one failure, open again only once the stream and the consumer
answer. On the session's real nats-server; a consumer that does not exist yet stands in for one with no leader
(both leave its info unanswered)."""

from __future__ import annotations

import asyncio

import pytest

from coderai.contracts.topology import WORK
from coderai.contracts.work import consumer_config, work_consumer
from coderai.gateway.fanout.gate import PROBE_EVERY_S, QueueGate


async def test_a_queue_that_failed_stays_closed_until_its_stream_and_consumer_answer(bus, unique):
    consumer = work_consumer(f"gate{unique}", "embed")
    other = work_consumer(f"gate{unique}", "rerank")
    gate = QueueGate(bus)
    assert gate.open(consumer)
    gate.failed(consumer, "nats: timeout")
    gate.failed(consumer, "nats: timeout")  # a second failure meanwhile starts no second probe
    assert not gate.open(consumer) and gate.open(other)  # only the queue that failed
    probe = gate._closed[consumer]
    with pytest.raises(TimeoutError):  # several probes go unanswered: it stays closed
        await asyncio.wait_for(asyncio.shield(probe), 4 * PROBE_EVERY_S)
    assert not gate.open(consumer)
    await bus.ensure_stream(WORK)
    await bus.js.add_consumer(WORK.name, config=consumer_config(consumer))
    try:
        await asyncio.wait_for(probe, 10)
        assert gate.open(consumer)
    finally:
        await bus.js.delete_consumer(WORK.name, consumer)


async def test_stopping_the_gateway_ends_its_probes(bus, unique):
    consumer = work_consumer(f"gate{unique}", "embed")
    gate = QueueGate(bus)
    gate.failed(consumer, "nats: no responders")
    probe = gate._closed[consumer]
    gate.stop()
    with pytest.raises(asyncio.CancelledError):
        await probe
    assert gate.open(consumer)
