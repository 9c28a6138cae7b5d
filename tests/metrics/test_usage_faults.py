"""The metrics service's usage under faults, over a real nats-server and a redis-server of its own that is killed
and started again: events that came while Redis was down are recorded once it is back (none lost, though later
batches are acked cumulatively), and none counted twice."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

import redis.asyncio as aioredis

from coderai.accounts.usage import day_of, read
from coderai.contracts import RequestCompleted
from coderai.contracts.subjects import EVT_REQUEST_COMPLETED
from coderai.metrics.service import Metrics
from coderai.metrics.settings import MetricsSettings
from coderai.runtime.bus import Bus
from coderai.runtime.embedded import RedisServer, free_port
from coderai.runtime.lifecycle import wait_for
from coderai.runtime.settings import load_settings


def done(key: str) -> RequestCompleted:
    return RequestCompleted(request_id=secrets.token_hex(12), ts=time.time(), key_name=key, model="m", op="chat",
                            status="ok", http_status=200, prompt_tokens=3, completion_tokens=2)


async def test_events_during_a_redis_outage_are_recorded_once_it_is_back(nats_server, tmp_path, unique):
    redis_server = RedisServer(tmp_path / "redis", port=free_port(), durable=True).start()
    key = f"k{unique}"
    settings = load_settings(MetricsSettings, "metrics", env={}, nats_url=nats_server.url, port=free_port(),
                             consumer=f"metrics-{unique}", redis_url=redis_server.url, batch_linger_s=0.01)
    r = aioredis.from_url(redis_server.url)

    async def requests() -> int:
        rows = await read(r, [day_of(time.time())], key=key)
        return rows[0]["requests"] if rows else 0

    try:
        async with contextlib.AsyncExitStack() as stack:
            metrics = Metrics(settings)
            await metrics.start(stack, asyncio.Event())
            bus = await Bus.connect(nats_server.url, "test-gateway")
            stack.push_async_callback(bus.close)

            async def send(n: int) -> None:
                for _ in range(n):
                    e = done(key)
                    await bus.js.publish(EVT_REQUEST_COMPLETED(), EVT_REQUEST_COMPLETED.encode(e),
                                         headers={"Nats-Msg-Id": e.request_id})

            await send(10)
            await wait_for(lambda: requests_seen(metrics, key) >= 10, 20, what="the first batch counted")
            redis_server.kill()
            await send(10)  # the batch that fails to reach Redis
            await send(10)  # later batches must not ack it away
            redis_server.start()
            await wait_for(lambda: requests_seen(metrics, key) >= 30, 30, what="every event counted once Redis is back")
            assert await requests() == 30
            assert requests_seen(metrics, key) == 30  # Prometheus counted what Redis took, once
    finally:
        await r.aclose()
        redis_server.stop()


def requests_seen(metrics: Metrics, key: str) -> float:
    return metrics.series.registry.get_sample_value("coderai_requests_total", {
        "key": key, "model": "m", "kind": "chat", "status": "ok", "engine": ""}) or 0.0
