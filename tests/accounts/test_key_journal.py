"""API keys outlive their Redis (`KeyJournal`, the `coderai_keys` bucket): every change goes to the journal, then
to Redis; a Redis that lost them (replaced by an empty one here) gets each back when it is asked for, revocations
and limits included, so a revoked key never comes back to life."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from coderai.accounts.keys import KeyError_, KeyJournal, KeyStore, digest
from coderai.contracts.topology import KEYS
from coderai.runtime.embedded import free_port
from coderai.runtime.embedded_redis import RedisServer


async def test_keys_and_revocations_come_back_to_an_emptied_redis(own_bus, tmp_path):
    server = RedisServer(tmp_path / "redis", port=free_port()).start()
    r = aioredis.from_url(server.url)
    try:
        store = KeyStore(r, KeyJournal(own_bus))
        alice_secret, alice = await store.create("alice", ["inference"], rpm=60)
        _, bob = await store.create("bob", ["inference", "admin"])
        await store.revoke("bob")
        await store.update("alice", tpm=5000)
        assert set(await (await own_bus.kv(KEYS)).keys()) == {  # digests and names, never a key
            alice.sha256,
            bob.sha256,
            "name." + b"alice".hex(),
            "name." + b"bob".hex(),
        }

        await r.flushall()  # a new, empty Redis
        got = await store.get(digest(alice_secret))  # what the gateway asks on a request with alice's key
        assert got is not None and (got.name, got.rpm, got.tpm, got.revoked) == ("alice", 60, 5000, False)
        assert await r.hget(f"coderai:key:{alice.sha256}", "tpm") == b"5000"  # put back for every gateway
        assert (await store.by_name("bob")).revoked  # a revoked key stays revoked
        assert [k.name for k in await store.list()] == ["alice", "bob"]
        with pytest.raises(KeyError_, match="exists"):
            await store.create("alice", ["inference"])  # its name is still taken
        assert await store.get(digest("sk-coderai-not-a-key")) is None
    finally:
        await r.aclose()
        server.stop()


async def test_without_a_journal_an_emptied_redis_loses_the_keys(tmp_path):
    server = RedisServer(tmp_path / "redis", port=free_port()).start()
    r = aioredis.from_url(server.url)
    try:
        store = KeyStore(r)
        secret, _ = await store.create("carol", ["inference"])
        await r.flushall()
        assert await store.get(digest(secret)) is None and await store.list() == []
    finally:
        await r.aclose()
        server.stop()
