"""Three nats-servers as three heads (`runtime/embedded.Routes`: routes with a password, over TLS both ways):
buckets made at three replicas, a bucket made at one raised to three when a connection with `replicas = 3` binds
it, a head SIGKILLed without a write lost, its singleton lease won by a candidate on another head, and the dead head
started again catching up."""

from __future__ import annotations

import secrets
import socket
import ssl

import pytest

from coderai.contracts.topology import BucketSpec
from coderai.runtime.bus import Bus
from coderai.runtime.embedded import NatsServer, Routes, free_port
from coderai.runtime.leader import Leader
from coderai.runtime.lifecycle import wait_for
from coderai.runtime.tls import client_context, ensure_certs

pytestmark = pytest.mark.slow


def _once_it_answers(check):
    """`check` as a predicate for `wait_for` that is false, not an error, while the cluster is still forming or
    electing its leaders."""

    async def predicate() -> bool:
        try:
            return bool(await check())
        except Exception:  # no meta leader yet, or a stream's leader moving
            return False

    return predicate


@pytest.fixture
def heads(tmp_path):
    certs = ensure_certs(tmp_path / "certs")  # one CA for every head (a joining head gets its certificate from it)
    password = secrets.token_urlsafe(24)
    routes = {name: f"127.0.0.1:{free_port()}" for name in ("a", "b", "c")}
    servers = {}
    for name, listen in routes.items():
        peers = tuple(r for n, r in routes.items() if n != name)
        servers[name] = NatsServer(
            tmp_path / name,
            port=free_port(),
            tls=certs,
            cluster=Routes(f"head-{name}", listen, peers, password, tls=certs),
        )
    try:  # every server stopped, the ones started before one that failed to start too
        for s in servers.values():
            s.start(log_file=s.data_dir / "nats.log")
        yield servers, certs
    finally:
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

        await wait_for(_once_it_answers(kv_ready), 60, what="the cluster to form and make an R3 bucket")
        kv = await ab.kv(BucketSpec("coderai_test_r3"))
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
        await wait_for(lambda: on_c.held, 60, what="head-c to lead")
        assert on_c.token > on_a.token

        got: dict = {}

        async def read_all() -> bool:  # the bucket's own leader may have died with a: read once it has a new one
            kv_c = await bc.kv(BucketSpec("coderai_test_r3"))
            got.update({k: (await kv_c.get(k)).value for k in (f"k{i}" for i in range(20))})
            return True

        await wait_for(_once_it_answers(read_all), 60, what="the bucket to answer on the survivors")
        assert got == {f"k{i}": str(i).encode() for i in range(20)}, "no write lost with a head"
        kv_c = await bc.kv(BucketSpec("coderai_test_r3"))
        await kv_c.put("after", b"a is down")

        servers["a"].start(log_file=servers["a"].data_dir / "nats.log")  # back: it rejoins and catches up
        only_a = await _bus(servers, certs, "a")
        try:

            async def caught_up():
                entry = await (await only_a.kv(BucketSpec("coderai_test_r3"))).get("after")
                return entry.value == b"a is down"

            await wait_for(_once_it_answers(caught_up), 60, what="head a to catch up")
        finally:
            await only_a.close()
        await on_c.stop()
    finally:
        await ab.close()
        await bc.close()
