"""What the accounts tests share: a nats-server and a redis-server of the test's own, so a journal, the EVENTS
stream and an emptied Redis hold only what the test put there."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from coderai.runtime.bus import Bus
from coderai.runtime.embedded import NatsServer, free_port
from coderai.runtime.embedded_redis import RedisServer


@pytest.fixture
async def own_bus(tmp_path):
    with NatsServer(tmp_path / "nats").start() as server:  # stopped whatever the test did, or if the connect fails
        bus = await Bus.connect(server.url, "test-accounts")
        try:
            yield bus
        finally:
            await bus.close()


@pytest.fixture
async def own_redis(tmp_path):
    """A client of a redis-server of the test's own (FLUSHALL it to lose Redis)."""
    with RedisServer(tmp_path / "redis", port=free_port()).start() as server:
        r = aioredis.from_url(server.url)
        try:
            yield r
        finally:
            await r.aclose()
