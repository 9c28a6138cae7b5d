"""The metrics service's usage under faults, over a real nats-server and a redis-server of its own that is killed
and started again: events that came while Redis was down are recorded once it is back (none lost, though later
batches are acked cumulatively), and none counted twice."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

import pytest
import redis.asyncio as aioredis

from coderai.accounts.usage import day_of, read
from coderai.contracts import RequestCompleted
from coderai.contracts.subjects import EVT_REQUEST_COMPLETED
from coderai.metrics.service import Metrics
from coderai.metrics.settings import MetricsSettings
from coderai.runtime.bus import Bus
from coderai.runtime.embedded import free_port
from coderai.runtime.embedded_redis import RedisServer
from coderai.runtime.lifecycle import wait_for
from coderai.runtime.settings import load_settings


def done(key: str) -> RequestCompleted:
    return RequestCompleted(
        request_id=secrets.token_hex(12),
        ts=time.time(),
        key_name=key,
        model="m",
        op="chat",
        status="ok",
        http_status=200,
        prompt_tokens=3,
        completion_tokens=2,
    )


async def send(bus: Bus, key: str, n: int) -> None:
    """`n` request.completed events of `key`, as a gateway's outbox publishes them."""
    for _ in range(n):
        e = done(key)
        await bus.js.publish(
            EVT_REQUEST_COMPLETED(), EVT_REQUEST_COMPLETED.encode(e), headers={"Nats-Msg-Id": e.request_id}
        )


async def requests_of(r, key: str) -> int:
    """Today's requests of `key` in Redis' usage."""
    rows = await read(r, [day_of(time.time())], key=key)
    return rows[0]["requests"] if rows else 0


@contextlib.asynccontextmanager
async def running(nats_server, settings: MetricsSettings):
    """A metrics service, and a bus to publish its events on, for the block."""
    async with contextlib.AsyncExitStack() as stack:
        metrics = Metrics(settings)
        await metrics.start(stack, asyncio.Event())
        bus = await Bus.connect(nats_server.url, "test-gateway")
        stack.push_async_callback(bus.close)
        yield metrics, bus


def settings_for(nats_server, unique: str, redis_url: str, **kw) -> MetricsSettings:
    return load_settings(
        MetricsSettings,
        "metrics",
        env={},
        nats_url=nats_server.url,
        port=free_port(),
        consumer=f"metrics-{unique}",
        redis_url=redis_url,
        batch_linger_s=0.01,
        **kw,
    )


async def test_events_during_a_redis_outage_are_recorded_once_it_is_back(nats_server, tmp_path, unique):
    redis_server = RedisServer(tmp_path / "redis", port=free_port(), durable=True).start()
    key = f"k{unique}"
    r = aioredis.from_url(redis_server.url)
    try:
        async with running(nats_server, settings_for(nats_server, unique, redis_server.url)) as (metrics, bus):
            await send(bus, key, 10)
            await wait_for(lambda: requests_seen(metrics, key) >= 10, 20, what="the first batch counted")
            redis_server.kill()
            await send(bus, key, 10)  # the batch that fails to reach Redis
            await send(bus, key, 10)  # later batches must not ack it away
            redis_server.start()
            await wait_for(lambda: requests_seen(metrics, key) >= 30, 30, what="every event counted once Redis is back")
            assert await requests_of(r, key) == 30
            assert requests_seen(metrics, key) == 30  # Prometheus counted what Redis took, once
    finally:
        await r.aclose()
        redis_server.stop()


async def test_a_batch_stored_whose_answer_was_lost_is_counted_by_prometheus_too(
    nats_server, tmp_path, unique, monkeypatch
):
    """Redis stores a batch and the connection breaks before its answer (Redis killed after EXEC): the retry finds
    the batch recorded. Prometheus counts it all the same, so it agrees with Redis (the soak saw it one short)."""
    from coderai.accounts import usage

    redis_server = RedisServer(tmp_path / "redis", port=free_port()).start()
    key, real, lost = f"k{unique}", usage.record_new, []

    async def answer_lost_once(r, events, mark, **kw):
        fresh = await real(r, events, mark, **kw)
        if not lost and any(e.key_name == key for _seq, e in events):
            lost.append(len(fresh))
            raise ConnectionError("Connection closed by server.")  # stored, but the reply never came
        return fresh

    monkeypatch.setattr(usage, "record_new", answer_lost_once)
    r = aioredis.from_url(redis_server.url)
    try:
        async with running(nats_server, settings_for(nats_server, unique, redis_server.url)) as (metrics, bus):
            await send(bus, key, 10)
            await wait_for(lambda: requests_seen(metrics, key) >= 10, 20, what="the batch counted by Prometheus")
            assert lost and await requests_of(r, key) == 10
            await send(bus, key, 5)
            await wait_for(lambda: requests_seen(metrics, key) >= 15, 20, what="the next batch counted")
            assert await requests_of(r, key) == 15 and requests_seen(metrics, key) == 15
    finally:
        await r.aclose()
        redis_server.stop()


async def test_a_batch_another_consumer_stored_meanwhile_is_not_counted_again(
    nats_server, tmp_path, unique, monkeypatch
):
    """While this consumer held a batch it could not record, another stored it and counted it: this head's next
    consumer, after the lease was lost and won again (the held batch's retry runs on, shielded). The retry finds the
    batch recorded by another writer and leaves it to that one; counting it, as a batch whose answer was lost, made
    Prometheus one over Redis in the soak."""
    from coderai.accounts import usage

    redis_server = RedisServer(tmp_path / "redis", port=free_port()).start()
    key, real, theirs = f"k{unique}", usage.record_new, []

    async def stored_by_another_once(r, events, mark, **kw):
        if not theirs and any(e.key_name == key for _seq, e in events):
            stored = await real(r, events, mark, **{**kw, "writer": "the-next-consumer"})
            theirs.append(sum(e.key_name == key for e in stored))
            raise ConnectionError("Connection closed by server.")  # this attempt failed; the other one stored it
        return await real(r, events, mark, **kw)

    monkeypatch.setattr(usage, "record_new", stored_by_another_once)
    r = aioredis.from_url(redis_server.url)
    try:
        async with running(nats_server, settings_for(nats_server, unique, redis_server.url)) as (metrics, bus):
            await send(bus, key, 10)
            await wait_for(lambda: theirs, 20, what="a batch stored by another consumer")
            await send(bus, key, 5)
            mine = 15 - theirs[0]
            await wait_for(lambda: requests_seen(metrics, key) >= mine, 20, what="the other batches counted")
            assert await requests_of(r, key) == 15
            assert requests_seen(metrics, key) == mine  # the other consumer's batch is its own to count
    finally:
        await r.aclose()
        redis_server.stop()


def requests_seen(metrics: Metrics, key: str) -> float:
    return (
        metrics.series.registry.get_sample_value(
            "coderai_requests_total", {"key": key, "model": "m", "kind": "chat", "status": "ok", "engine": ""}
        )
        or 0.0
    )


async def test_one_head_counts_usage_and_a_new_leader_recounts_what_the_last_one_held(nats_server, tmp_path, unique):
    """Two heads' metrics services on one EVENTS stream: only the lease holder counts. The first leader fetches a
    batch it cannot record (its Redis died) and steps down holding it; the new leader starts from what its Redis
    counted, not from the consumer's acks, so its cumulative acks of later batches do not ack that batch away
    unrecorded: every event is counted, once."""
    key, consumer = f"k{unique}", f"metrics-{unique}"
    redis_a = RedisServer(tmp_path / "redis-a", port=free_port()).start()
    try:
        redis_b = RedisServer(tmp_path / "redis-b", port=free_port()).start()
    except Exception:
        redis_a.stop()
        raise

    def head(name: str, redis_url: str) -> MetricsSettings:
        return settings_for(nats_server, unique, redis_url, node_id=name)

    r = aioredis.from_url(redis_b.url)
    try:
        async with contextlib.AsyncExitStack() as stack:
            bus = await Bus.connect(nats_server.url, "test-gateway")
            stack.push_async_callback(bus.close)
            info = await bus.js.stream_info("EVENTS")  # both Redises have counted what the stream held so far
            mark = f"coderai:usage:applied:{consumer}:{int(info.created.timestamp())}"
            for url in (redis_a.url, redis_b.url):
                async with aioredis.from_url(url) as c:
                    await c.set(mark, info.state.last_seq)
            a, b = Metrics(head("head-a", redis_a.url)), Metrics(head("head-b", redis_b.url))
            a_stack = await stack.enter_async_context(contextlib.AsyncExitStack())
            await a.start(a_stack, asyncio.Event())
            await b.start(stack, asyncio.Event())
            assert a.leader.held and not b.leader.held

            async def held_by_a() -> bool:
                return (await bus.js.consumer_info("EVENTS", consumer)).num_ack_pending > 0

            await wait_for(lambda: a.applied == info.state.last_seq, 20, what="head A counting from Redis' mark")
            redis_a.kill()
            await send(bus, key, 10)
            await wait_for(held_by_a, 20, what="head A holding the batch it cannot record")
            await a.leader.stop()  # steps down, its batch fetched and never acked
            await wait_for(lambda: b.leader.held, 20, what="head B leading")
            await send(bus, key, 10)  # head B acks these cumulatively
            await wait_for(lambda: requests_seen(b, key) >= 20, 30, what="every event counted by head B")
            assert await requests_of(r, key) == 20 and requests_seen(b, key) == 20
            assert requests_seen(a, key) == 0  # Prometheus counts only what Redis took
    finally:
        await r.aclose()
        redis_a.stop()
        redis_b.stop()


@pytest.mark.parametrize("loss", ["emptied", "went back"])
async def test_usage_a_redis_lost_is_counted_again_from_the_events(nats_server, tmp_path, unique, loss):
    """Redis loses usage it had taken: replaced by an empty one ("emptied"), or a replica that had not yet received
    the last batches is promoted by Sentinel ("went back": replication is asynchronous, so it holds an older mark
    and older usage, never nothing; CI's SIGKILL of the leading head once left usage short by the batches its
    Redis took just before it died). The metrics service sees the mark gone or behind the one it saw stored, even
    while no events come, and counts EVENTS again from what Redis still holds, so usage is whole again; Prometheus,
    which never lost its counts, does not count them twice."""
    redis_server = RedisServer(tmp_path / "redis", port=free_port()).start()
    key = f"k{unique}"
    r = aioredis.from_url(redis_server.url)

    def usage_is(n: int):
        async def check() -> bool:
            return await requests_of(r, key) == n

        return check

    try:
        async with running(nats_server, settings_for(nats_server, unique, redis_server.url)) as (metrics, bus):
            await send(bus, key, 10)
            await wait_for(lambda: requests_seen(metrics, key) >= 10, 20, what="the first events counted")
            replica = {k: await r.dump(k) for k in await r.keys("*")}  # what a replica had received
            await send(bus, key, 10)
            await wait_for(lambda: requests_seen(metrics, key) >= 20, 20, what="the next events counted")
            async with r.pipeline(transaction=True) as pipe:  # at once: the consumer never reads it half done
                pipe.flushall()
                for k, dumped in replica.items() if loss == "went back" else ():
                    pipe.restore(k, 0, dumped)
                await pipe.execute()
            assert await requests_of(r, key) == (10 if loss == "went back" else 0)
            await wait_for(usage_is(20), 30, what="usage counted again, whole, while no events came")
            await send(bus, key, 5)
            await wait_for(usage_is(25), 30, what="the next events counted")
            assert requests_seen(metrics, key) == 25  # Prometheus counted each event once
    finally:
        await r.aclose()
        redis_server.stop()


async def test_a_batch_given_up_when_the_lease_lapsed_is_counted_once_the_lease_is_held_again(
    nats_server, tmp_path, unique
):
    """A full disk: the lease's renewals are not stored, so it lapses, and Redis refuses the batch in hand. The
    consumer gives the batch up; the head leads again once renewals are stored, and starts from Redis' mark. The
    batch is counted then by Redis and Prometheus both (the soak saw Prometheus one short: the given-up batch had
    been taken as applied, so Prometheus skipped it when it came again)."""
    redis_server = RedisServer(tmp_path / "redis", port=free_port(), durable=True).start()
    key = f"k{unique}"
    r = aioredis.from_url(redis_server.url)
    try:
        async with running(nats_server, settings_for(nats_server, unique, redis_server.url)) as (metrics, bus):
            results: list = []
            record = metrics._record

            async def noted(events, mark):
                results.append(got := await record(events, mark))
                return got

            metrics._record = noted
            await send(bus, key, 5)
            await wait_for(lambda: requests_seen(metrics, key) >= 5, 20, what="the first events counted")
            renewals = metrics.leader._task
            renewals.cancel()  # no renewal stored, as on the full disk
            with contextlib.suppress(asyncio.CancelledError):
                await renewals
            metrics.leader._valid_until = 0.0  # the lease lapsed
            redis_server.kill()
            before = len(results)
            await send(bus, key, 10)
            await wait_for(lambda: any(not got for got in results[before:]), 30, what="the batch given up")
            redis_server.start()
            metrics.leader.start()  # renewals stored again: the lapse is seen, and the lease held again
            await wait_for(lambda: metrics.leader.held, 20, what="the lease held again")
            await send(bus, key, 5)

            async def whole() -> bool:
                return await requests_of(r, key) == 20 and requests_seen(metrics, key) == 20

            await wait_for(whole, 30, what="every event counted by Redis and Prometheus")
            assert await requests_of(r, key) == 20 and requests_seen(metrics, key) == 20
    finally:
        await r.aclose()
        redis_server.stop()
