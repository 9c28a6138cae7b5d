"""A shared `WORK` consumer is the scheduler's: a node holding the model binds it and pulls its parts, but may not
make it or change its settings (attack: a holder re-created it with a 1 ms ack wait and one delivery, so every
other holder's parts were dropped after a millisecond). On a real, secured nats-server, with the node's rights as
the head renders them."""

from __future__ import annotations

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from coderai.contracts.topology import WORK
from coderai.contracts.work import ACK_WAIT_S, MAX_DELIVER, work_consumer
from coderai.runtime import members
from coderai.runtime.bus import Bus
from coderai.runtime.embedded import NatsServer
from coderai.scheduler.membership import Membership


@pytest.fixture
def secured_nats(tmp_path):
    server = NatsServer.secured(tmp_path / "nats").start()
    yield server
    server.stop()


def _holds(server: NatsServer, node_id: str, consumers: list[str]) -> None:
    """Give member `node_id` the rights to `consumers`, as the scheduler's grant does."""
    with members.file_lock(server.members_file):
        reg = members.load(server.members_file)
        reg.members[node_id].work = consumers
        members.save(server.members_file, reg)
        members.write_users(server.users_file, reg)
    server.reload()


async def test_a_node_binds_the_shared_consumer_but_cannot_change_it(secured_nats):
    c = work_consumer("minilm", "embed")
    service = await Bus.connect(secured_nats.service_url, "scheduler")
    node_url = secured_nats.add_node("n1")
    _holds(secured_nats, "n1", [c])
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    try:
        await service.ensure_stream(WORK)
        sched = Membership.__new__(Membership)  # only what make_consumers uses
        sched.bus, sched.made = service, set()
        await sched.make_consumers([c])
        # the node's rights are applied a moment after the reload: its first attempt waits for them
        node = await nats.connect(node_url, inbox_prefix=members.node_inbox("n1"), error_cb=on_error)
        try:
            js = node.jetstream()
            evil = ConsumerConfig(
                name=c,
                durable_name=c,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=0.001,
                max_deliver=1,
                filter_subject="coderai.work.minilm.embed",
            )
            with pytest.raises(Exception) as refused:  # a permissions violation: no answer comes back
                await js.add_consumer(WORK.name, config=evil, timeout=2)
            info = await service.js.consumer_info(WORK.name, c)
            print(
                f"a holder re-making the shared consumer with a 1 ms ack wait: {type(refused.value).__name__}; "
                f"its ack wait is still {info.config.ack_wait} s, max deliver {info.config.max_deliver}"
            )
            assert (info.config.ack_wait, info.config.max_deliver) == (ACK_WAIT_S, MAX_DELIVER)
            assert any("permissions violation" in e.lower() and "consumer.create" in e.lower() for e in errors), errors
            # what a holder does need still works: bind the consumer and pull a part
            await service.js.publish("coderai.work.minilm.embed", b"part")
            sub = await js.pull_subscribe("coderai.work.minilm.embed", durable=c, stream=WORK.name)
            [msg] = await sub.fetch(1, timeout=5)
            assert msg.data == b"part"
            await msg.ack()
        finally:
            await node.close()
    finally:
        await service.close()


async def test_the_scheduler_sets_a_tampered_consumer_back(secured_nats):
    """A consumer changed before this rule (or by a service) is set back to its one config when the scheduler
    makes it again (each scheduler run, and after a reconnect)."""
    c = work_consumer("tiny", "chat")
    service = await Bus.connect(secured_nats.service_url, "scheduler")
    try:
        await service.ensure_stream(WORK)
        await service.js.add_consumer(
            WORK.name,
            config=ConsumerConfig(
                name=c,
                durable_name=c,
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=0.5,
                max_deliver=1,
                filter_subject="coderai.work.tiny.chat",
            ),
        )
        sched = Membership.__new__(Membership)
        sched.bus, sched.made = service, set()
        await sched.make_consumers([c])
        info = await service.js.consumer_info(WORK.name, c)
        assert (info.config.ack_wait, info.config.max_deliver) == (ACK_WAIT_S, MAX_DELIVER)
    finally:
        await service.close()


def test_a_nodes_rights_name_no_consumer_creation():
    pub = members.node_permissions("n1", [work_consumer("minilm", "embed")])["publish"]["allow"]
    assert not [p for p in pub if ".CONSUMER.CREATE.WORK" in p or ".CONSUMER.DURABLE.CREATE.WORK" in p]
