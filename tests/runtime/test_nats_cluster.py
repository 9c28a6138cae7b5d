"""Three nats-servers as three heads (`runtime/embedded.Routes`: routes with a password, over TLS both ways):
buckets made at three replicas, a bucket made at one raised to three when a connection with `replicas = 3` binds
it, a head SIGKILLed without a write lost, its singleton lease won by a candidate on another head, and the dead head
started again catching up."""

from __future__ import annotations

import asyncio
import secrets
import socket
import ssl
import time

import pytest

from coderai.contracts.topology import BucketSpec
from coderai.runtime.bus import Bus
from coderai.runtime.embedded import NatsServer, Routes, free_port
from coderai.runtime.leader import Leader
from coderai.runtime.tls import client_context, ensure_certs

pytestmark = pytest.mark.slow


async def _until(cond, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = await cond()
        except Exception as exc:  # noqa: BLE001 - the cluster is still forming or electing
            got, why = None, exc
        else:
            why = None
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what} ({why})"
        await asyncio.sleep(0.1)


@pytest.fixture
def heads(tmp_path):
    certs = ensure_certs(tmp_path / "certs")  # one CA for every head (a joining head gets its certificate from it)
    password = secrets.token_urlsafe(24)
    routes = {name: f"127.0.0.1:{free_port()}" for name in ("a", "b", "c")}
    servers = {}
    for name, listen in routes.items():
        peers = tuple(r for n, r in routes.items() if n != name)
        servers[name] = NatsServer(tmp_path / name, port=free_port(), tls=certs,
                                   cluster=Routes(f"head-{name}", listen, peers, password, tls=certs))
    for s in servers.values():
        s.start(log_file=s.data_dir / "nats.log")
    yield servers, certs
    for s in servers.values():
        s.stop()


async def _bus(servers, certs, names: str, replicas: int = 3) -> Bus:
    url = ",".join(servers[n].url for n in names)
    bus = await Bus.connect(url, f"test-{names}", tls=client_context(certs.ca_pem))
    bus.replicas = replicas
    return bus


def test_routes_speak_tls_both_ways(heads):
    """A route port answers TLS only, and only to a peer whose certificate the heads' CA signed."""
    servers, certs = heads
    host, port = servers["b"].cluster.listen.rsplit(":", 1)

    def handshake(ctx: ssl.SSLContext) -> bytes:
        with socket.create_connection((host, int(port)), timeout=5) as raw, ctx.wrap_socket(raw) as tls:
            return tls.recv(4096)  # a route's INFO, once the server has checked the certificate

    stranger = client_context(certs.ca_pem)  # trusts the heads, but has no certificate of theirs
    try:
        answer = handshake(stranger)
    except (ssl.SSLError, OSError):  # refused in the handshake (TLS 1.3 says so on the first read)
        answer = b""
    assert not answer.startswith(b"INFO"), "a peer without a head's certificate got an answer"
    peer = client_context(certs.ca_pem)
    peer.load_cert_chain(certs.cert, certs.key)
    assert handshake(peer).startswith(b"INFO ")
    with socket.create_connection((host, int(port)), timeout=5) as plain:  # no TLS at all: nothing readable
        plain.settimeout(3)
        try:
            got = plain.recv(4096)
        except (TimeoutError, ConnectionError):
            got = b""
    assert b'"cluster"' not in got


async def test_three_heads_replicate_and_survive_one(heads):
    servers, certs = heads
    ab = await _bus(servers, certs, "ab")
    bc = await _bus(servers, certs, "bc")
    try:
        async def kv_ready():  # JetStream needs its meta leader elected over the routes first
            return await ab.kv(BucketSpec("coderai_test_r3"))

        kv = await _until(kv_ready, "the cluster to form and make an R3 bucket")
        info = await ab.js.stream_info("KV_coderai_test_r3")
        assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2, "a leader and two followers"
        for i in range(20):
            await kv.put(f"k{i}", str(i).encode())

        one = await _bus(servers, certs, "a", replicas=1)  # a bucket made before the other heads joined
        try:
            await one.kv(BucketSpec("coderai_test_r1"))
            assert (await one.js.stream_info("KV_coderai_test_r1")).config.num_replicas == 1
        finally:
            await one.close()
        await ab.kv(BucketSpec("coderai_test_r1"))  # bound by a connection that wants three: raised
        assert (await ab.js.stream_info("KV_coderai_test_r1")).config.num_replicas == 3

        spec = BucketSpec("coderai_test_leaders", ttl_s=3.0)
        await ab.kv(spec)
        on_a = Leader(ab, "scheduler", "head-a", spec=spec)
        on_c = Leader(bc, "scheduler", "head-c", spec=spec)
        assert await on_a.try_once()
        on_a.start()
        on_c.start()

        servers["a"].kill()  # head a dies with its scheduler: no step-down
        on_a._task.cancel()
        won = await _until(lambda: _true(on_c.held), "head-c to lead", timeout_s=60)
        assert won and on_c.token > on_a.token

        kv_c = await bc.kv(BucketSpec("coderai_test_r3"))
        got = {k: (await kv_c.get(k)).value for k in (f"k{i}" for i in range(20))}
        assert got == {f"k{i}": str(i).encode() for i in range(20)}, "no write lost with a head"
        await kv_c.put("after", b"a is down")

        servers["a"].start(log_file=servers["a"].data_dir / "nats.log")  # back: it rejoins and catches up
        only_a = await _bus(servers, certs, "a")
        try:
            async def caught_up():
                entry = await (await only_a.kv(BucketSpec("coderai_test_r3"))).get("after")
                return entry.value == b"a is down"

            assert await _until(caught_up, "head a to catch up")
        finally:
            await only_a.close()
        await on_c.stop()
    finally:
        await ab.close()
        await bc.close()


async def _true(value: bool) -> bool:
    return value
