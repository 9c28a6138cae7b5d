"""The derived auth block against a real nats-server: strangers are refused, nodes get only their subjects."""

from __future__ import annotations

import asyncio

import nats
import nats.errors
import pytest

from coderai.runtime.lifecycle import wait_for

from coderai.contracts import BusError
from coderai.contracts.routing import RouteRequest
from coderai.contracts.subjects import ROUTE_PICK
from coderai.runtime.bus import Bus, refused_subject
from coderai.runtime.cluster import nats_auth_config, with_credentials
from coderai.runtime.embedded import NatsServer

TOKEN = "tok"
BUCKET = "coderai_assignments"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = NatsServer(tmp_path_factory.mktemp("nats-auth"), auth=nats_auth_config(TOKEN)).start()
    yield s
    s.stop()


async def connect(url: str, **kw) -> nats.NATS:
    return await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2, **kw)


async def wait_until(cond, timeout_s: float = 5.0) -> None:
    await wait_for(cond, timeout_s, interval_s=0.01)


@pytest.fixture
async def as_role(server):
    conns: list[nats.NATS] = []

    async def make(role: str, **kw) -> nats.NATS:
        nc = await connect(with_credentials(server.url, TOKEN, role), **kw)
        conns.append(nc)
        return nc

    yield make
    for nc in conns:
        if not nc.is_closed:
            await nc.close()


async def _quiet(_e: Exception) -> None:
    pass  # nats-py logs connection errors through error_cb; the test only cares that connect raises


async def test_a_client_without_credentials_is_refused(server):
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await connect(server.url, error_cb=_quiet)


async def test_credentials_from_another_token_are_refused(server):
    for role in ["service", "node"]:
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await connect(with_credentials(server.url, "not-" + TOKEN, role), error_cb=_quiet)


async def test_both_roles_connect_with_the_right_token(as_role):
    for role in ["service", "node"]:
        nc = await as_role(role)
        assert nc.is_connected


async def test_a_node_may_heartbeat_but_not_route(as_role):
    errors: list[Exception] = []

    async def collect(e: Exception) -> None:
        errors.append(e)

    service = await as_role("service")
    got: asyncio.Queue = asyncio.Queue()

    async def on_hb(msg):
        await got.put(msg.subject)

    await service.subscribe("coderai.hb.*", cb=on_hb)
    await service.flush()
    node = await as_role("node", error_cb=collect)
    await node.publish("coderai.hb.x", b"{}")
    await node.flush()
    assert await asyncio.wait_for(got.get(), 5) == "coderai.hb.x"
    assert errors == []

    await node.publish("coderai.route.pick", b"{}")
    await node.flush()
    await wait_until(lambda: errors)
    assert "permissions violation" in str(errors[0]).lower()
    assert "coderai.route.pick" in str(errors[0])
    assert node.is_connected  # a refused publish is reported, not fatal


async def test_a_node_reads_its_assignment_but_cannot_write_it(as_role):
    service = await as_role("service")
    kv = await service.jetstream().create_key_value(bucket=BUCKET)
    await kv.put("n1", b"v1")

    node = await as_role("node", error_cb=_quiet)
    js = node.jetstream(timeout=2)
    node_kv = await js.key_value(BUCKET)
    watcher = await node_kv.watch("n1")
    try:
        entry = await watcher.updates(timeout=5)
        assert (entry.key, entry.value) == ("n1", b"v1")
        await kv.put("n1", b"v2")
        entry = await watcher.updates(timeout=5)
        while entry is None:  # the end-of-initial-values marker may come first
            entry = await watcher.updates(timeout=5)
        assert entry.value == b"v2"

        # the server drops the publish (and says so on error_cb), so the JetStream ack never comes
        with pytest.raises((nats.errors.TimeoutError, asyncio.TimeoutError)):
            await asyncio.wait_for(node_kv.put("n1", b"forged"), 5)
    finally:
        await watcher.stop()
    assert (await kv.get("n1")).value == b"v2"


async def test_a_node_reads_uploads_and_writes_results_in_the_blob_store(as_role):
    from coderai.contracts import Blob
    from coderai.runtime.blobs import BlobStore
    from coderai.runtime.bus import Bus

    service = Bus(await as_role("service"))
    node = Bus(await as_role("node"))
    upload = await BlobStore(service, create=True).put(b"u" * 300_000)
    assert await BlobStore(node).get(upload) == b"u" * 300_000
    result = await BlobStore(node).put(b"r" * 300_000, suffix=".png")
    assert await BlobStore(service).get(Blob(name=result.name)) == b"r" * 300_000


def test_refused_subject_reads_the_servers_words():
    assert refused_subject("nats: permissions violation for publish to \"coderai.route.pick\"") == "coderai.route.pick"
    assert refused_subject("Permissions Violation for Publish to coderai.cmd.x") == "coderai.cmd.x"
    assert refused_subject("Permissions Violation for Subscription to \"coderai.>\"") == ""
    assert refused_subject("Authorization Violation") == ""


async def test_a_request_the_server_refuses_fails_at_once_instead_of_timing_out(server):
    node = await Bus.connect(with_credentials(server.url, TOKEN, "node"), "node-test")
    try:
        with pytest.raises(BusError) as caught:  # a wait for the timeout would end as code "timeout"
            await node.request(ROUTE_PICK, RouteRequest(model="m", op="chat", request_id="r1"), timeout=30)
        assert caught.value.code == "internal" and not caught.value.retryable
        assert "coderai.route.pick" in caught.value.message and "may not publish" in caught.value.message
        assert node.connected  # and the connection goes on
    finally:
        await node.close()
