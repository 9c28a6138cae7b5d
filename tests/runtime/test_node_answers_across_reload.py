"""A node's answers survive a users reload. nats-server forgets the reply rights `allow_responses` gave at every
reload of its users (each join, revocation or pod), so a node streaming an answer when another node joined had its
next frames refused and the request cut; and a fan-out part it acked after a reload was delivered again. A node
now answers into the gateways' and the scheduler's inboxes, and acks its own work consumers, outright. On a real,
secured nats-server with the rights the head renders."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from coderai.contracts.topology import WORK
from coderai.contracts.work import work_consumer
from coderai.runtime import members
from coderai.runtime.embedded import NatsServer
from coderai.scheduler.membership import Membership
from coderai.runtime.bus import Bus


@pytest.fixture
def secured_nats(tmp_path):
    server = NatsServer.secured(tmp_path / "nats").start()
    yield server
    server.stop()


async def _until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)  # a poll with a deadline


async def test_a_streamed_answer_goes_on_across_a_users_reload(secured_nats):
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    async def on_disconnect() -> None:
        errors.append("the node's connection dropped")

    # the gateway's connection as the head runs it: its replies come to its own inbox, `_S.gateway`
    gateway = await nats.connect(secured_nats.service_url, inbox_prefix=members.service_inbox("gateway"))
    node = await nats.connect(
        secured_nats.add_node("n1"),
        inbox_prefix=members.node_inbox("n1"),
        error_cb=on_error,
        disconnected_cb=on_disconnect,
    )
    try:
        jobs: asyncio.Queue = asyncio.Queue()

        async def on_job(m) -> None:
            await jobs.put(m)

        await node.subscribe("coderai.engine.n1.e.chat", cb=on_job)
        await node.flush()
        frames: list[bytes] = []

        async def on_frame(m) -> None:
            frames.append(m.data)

        inbox = gateway.new_inbox()
        await gateway.subscribe(inbox, cb=on_frame)
        # The job is sent again until the node has it: CI once saw the first one never arrive (the node had just
        # joined, its reload being applied; not reproduced in 300 stressed runs here). What this test checks is the
        # answer across the next reload; a job that never arrives fails with what the node was told.
        deadline = time.monotonic() + 20
        job = None
        while job is None:
            assert time.monotonic() < deadline, f"the job never reached the node: {errors}"
            await gateway.publish("coderai.engine.n1.e.chat", b"job", reply=inbox)
            try:
                job = await asyncio.wait_for(jobs.get(), 2)
            except TimeoutError:
                pass
        await node.publish(job.reply, b"frame 1")
        await _until(lambda: frames == [b"frame 1"])
        secured_nats.add_node("n2")  # another node joins: the users file is rewritten and reloaded
        await node.publish(job.reply, b"frame 2")
        await _until(lambda: len(frames) == 2 or any("permissions violation" in e.lower() for e in errors))
        print(f"frames the gateway got across a join: {frames}; refusals: {errors}")
        assert frames == [b"frame 1", b"frame 2"] and not errors
    finally:
        await node.close()
        await gateway.close()


async def test_a_part_acked_after_a_users_reload_is_not_delivered_again(secured_nats):
    c = work_consumer("minilm", "embed")
    scheduler = await Bus.connect(secured_nats.service_url, "scheduler")
    node_url = secured_nats.add_node("n1")
    with members.file_lock(secured_nats.members_file):
        reg = members.load(secured_nats.members_file)
        reg.members["n1"].work = [c]
        members.save(secured_nats.members_file, reg)
        members.write_users(secured_nats.users_file, reg)
    secured_nats.reload()
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    try:
        await scheduler.ensure_stream(WORK)
        sched = Membership.__new__(Membership)
        sched.bus, sched.made = scheduler, set()
        await sched.make_consumers([c])
        node = await nats.connect(node_url, inbox_prefix=members.node_inbox("n1"), error_cb=on_error)
        try:
            sub = None
            deadline = time.monotonic() + 10
            while sub is None:  # its grant is applied a moment after the reload
                try:
                    sub = await node.jetstream().pull_subscribe(
                        "coderai.work.minilm.embed", durable=c, stream=WORK.name
                    )
                except Exception:  # not yet
                    assert time.monotonic() < deadline, errors
                    await asyncio.sleep(0.05)  # a poll with a deadline
            await scheduler.js.publish("coderai.work.minilm.embed", b"part")
            [msg] = await sub.fetch(1, timeout=5)
            secured_nats.add_node("n2")  # a join while the part runs
            await msg.ack_sync(timeout=5)  # JetStream answers an ack it took
            info = await scheduler.js.consumer_info(WORK.name, c)
            print(f"a part acked across a join: {info.num_ack_pending} pending, {info.num_redelivered} redelivered")
            assert info.num_ack_pending == 0 and info.num_redelivered == 0
        finally:
            await node.close()
    finally:
        await scheduler.close()
