"""Redis across heads, on real processes: a master, one replica and one sentinel on loopback. A client from
`redis_client.connect("redis+sentinel://...")` keeps working after the master is SIGKILLed and the sentinel has
promoted the replica; the one-connection blocking pool the metrics service uses stays one connection through it.
Plus the Sentinel URL's parsing."""

from __future__ import annotations

import pytest
import redis
from redis.exceptions import RedisError

from coderai.runtime import redis_client
from coderai.runtime.embedded import free_port
from coderai.runtime.embedded_redis import RedisSentinel, RedisServer
from coderai.runtime.lifecycle import wait_for
from coderai.testing.procs import wait_until

PASSWORD = "s3cret/with@odd:chars"


def test_parses_a_sentinel_url_with_password_several_sentinels_and_db():
    url = "redis+sentinel://:s3cret%2Fx@127.0.0.1:26379,10.0.0.2:26380,[::1]:26381,head-c/coderai/3"
    parsed = redis_client.parse_sentinel_url(url)
    assert parsed.sentinels == (("127.0.0.1", 26379), ("10.0.0.2", 26380), ("::1", 26381), ("head-c", 26379))
    assert parsed.master == "coderai"
    assert parsed.db == 3
    assert parsed.password == "s3cret/x"
    assert parsed.username is None
    assert parsed.sentinel_password is None


def test_parses_user_no_db_and_a_sentinel_password():
    parsed = redis_client.parse_sentinel_url("redis+sentinel://svc:pw@h:1/m?sentinel_password=sp")
    assert (parsed.username, parsed.password, parsed.sentinel_password) == ("svc", "pw", "sp")
    assert (parsed.sentinels, parsed.master, parsed.db) == ((("h", 1),), "m", 0)
    assert redis_client.parse_sentinel_url("redis+sentinel://h:1/m/").db == 0


@pytest.mark.parametrize(
    "url, says",
    [
        ("redis+sentinel://:topsecret@h:1", "no master name"),
        ("redis+sentinel://:topsecret@/m", "no sentinel address"),
        ("redis+sentinel://:topsecret@h:port/m", "bad sentinel port"),
        ("redis+sentinel://:topsecret@h:1,:2/m", "empty sentinel host"),
        ("redis+sentinel://:topsecret@h:1/m/zero", "bad database number"),
        ("redis+sentinel://:topsecret@h:1/m/0/x", "too many path parts"),
        ("redis+sentinel://:topsecret@h:1/m?db=2", "unknown option"),
        ("redis://:topsecret@h:1/0", r"not a redis\+sentinel"),
    ],
)
def test_a_bad_url_is_a_clear_value_error_without_the_password(url, says):
    with pytest.raises(ValueError, match=says) as err:
        redis_client.parse_sentinel_url(url)
    assert "topsecret" not in str(err.value)
    assert ":***@" in str(err.value)


def test_mask_hides_passwords_in_userinfo_and_query():
    assert (
        redis_client.mask("redis+sentinel://u:pw@a:1,b:2/m?sentinel_password=sp")
        == "redis+sentinel://u:***@a:1,b:2/m?sentinel_password=***"
    )
    assert redis_client.mask("redis://h:1/0") == "redis://h:1/0"


@pytest.fixture
def trio(tmp_path):
    """A master with a password, its replica (linked), and a sentinel that knows both."""
    servers = []
    try:
        master = RedisServer(tmp_path / "master", password=PASSWORD).start(log_file=tmp_path / "master.log")
        servers.append(master)
        info = redis.Redis(port=master.port, password=PASSWORD, decode_responses=True)
        info.config_set("repl-diskless-sync-delay", 0)  # not 5 s waiting for more replicas to share the transfer
        replica = RedisServer(tmp_path / "replica", password=PASSWORD, replicaof=f"127.0.0.1:{master.port}")
        servers.append(replica.start(log_file=tmp_path / "replica.log"))
        # linked before the sentinel starts: it reads the replicas from the master's INFO at once, then every 10 s
        wait_until(
            lambda: info.info("replication").get("slave0", {}).get("state") == "online", 15, "the replica's link"
        )
        info.close()
        sentinel = RedisSentinel(tmp_path / "sentinel", f"127.0.0.1:{master.port}", password=PASSWORD)
        servers.append(sentinel.start(log_file=tmp_path / "sentinel.log"))
        sentinel.wait_replicas(1)
        yield master, replica, sentinel
    finally:
        for s in reversed(servers):
            s.stop()


def _url(sentinel: RedisSentinel) -> str:
    from urllib.parse import quote

    return f"redis+sentinel://:{quote(PASSWORD, safe='')}@127.0.0.1:{sentinel.port}/{sentinel.name}/0"


async def _write_ok(client, key: str, value: str) -> bool:
    try:
        await client.set(key, value)
        return await client.get(key) == value.encode()
    except RedisError:  # the old master gone, the new one not promoted yet
        return False


@pytest.mark.parametrize("blocking", [False, True], ids=["pool", "one-connection"])
async def test_a_sentinel_client_follows_the_master_through_a_failover(trio, blocking):
    master, replica, sentinel = trio
    opts = {"blocking": True, "max_connections": 1, "timeout": None} if blocking else {}
    client = redis_client.connect(_url(sentinel), **opts)
    try:
        await client.set("before", "1")
        assert await client.wait(1, 5000) == 1  # on the replica too, so the failover keeps it
        assert sentinel.master_address() == f"127.0.0.1:{master.port}"
        master.kill()
        await wait_for(
            lambda: _write_ok(client, "after", "2"),
            20,
            interval_s=0.1,
            what="a write through the same client after the failover",
        )
        assert sentinel.master_address() == f"127.0.0.1:{replica.port}"
        assert await client.get("before") == b"1"
        assert (await client.info("replication"))["role"] == "master"
        if blocking:
            pool = client.connection_pool
            assert len(pool._in_use_connections) + len(pool._available_connections) == 1
    finally:
        await client.aclose()


async def test_a_plain_url_still_gives_a_plain_client(tmp_path):
    with RedisServer(tmp_path / "r").start() as server:
        client = redis_client.connect(server.url)
        try:
            await client.set("k", "v")
            assert await client.get("k") == b"v"
        finally:
            await client.aclose()
        pool = redis_client.connection_pool(server.url, blocking=True, max_connections=1, timeout=None)
        assert pool.max_connections == 1 and pool.timeout is None
        await pool.aclose()


def test_coderai_keys_works_through_a_sentinel_url(trio, capsys):
    from coderai.accounts import cli

    _, _, sentinel = trio
    assert cli.main(["--redis-url", _url(sentinel), "create", "alice", "--rpm", "5"]) == 0
    assert cli.main(["--redis-url", _url(sentinel), "list"]) == 0
    out = capsys.readouterr().out
    assert '"name": "alice"' in out and out.count('"rpm": 5') == 2


def test_a_replica_named_a_master_that_is_no_master_stops_waiting_for_it(tmp_path):
    """A head restarted during a failover may be given a stale master by the sentinels: a replica whose own master
    is gone (it answers NOMASTERLINK) or a server that is down. `wait_synced` says so within seconds, instead of
    waiting out its whole timeout (it held every restarted head 60 s); a real master is still waited for."""
    import time as clock

    from coderai.runtime.embedded import EmbeddedServerError

    gone = free_port()
    stale = RedisServer(tmp_path / "stale", password=PASSWORD, replicaof=f"127.0.0.1:{gone}").start()
    try:
        for name in (f"127.0.0.1:{stale.port}", f"127.0.0.1:{free_port()}"):  # a masterless replica; nobody
            late = RedisServer(tmp_path / f"late-{name[-5:]}", password=PASSWORD, replicaof=name).start()
            try:
                began = clock.monotonic()
                with pytest.raises(EmbeddedServerError, match="is no master"):
                    late.wait_synced(timeout_s=60, check_s=1)
                assert clock.monotonic() - began < 15
            finally:
                late.stop()
        master = RedisServer(tmp_path / "master", password=PASSWORD).start()
        try:
            follower = RedisServer(tmp_path / "follower", password=PASSWORD, replicaof=f"127.0.0.1:{master.port}")
            follower.start()
            try:
                follower.wait_synced(timeout_s=60, check_s=1)  # returns once linked
            finally:
                follower.stop()
        finally:
            master.stop()
    finally:
        stale.stop()
