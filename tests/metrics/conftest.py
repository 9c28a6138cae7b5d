"""What the metrics tests share: a client of the session's redis-server."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis


@pytest.fixture
async def r(redis_server):
    client = aioredis.from_url(redis_server.url)
    yield client
    await client.aclose()
