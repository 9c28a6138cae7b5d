"""Per-key usage counters in a real Redis: day and month hashes, overall and per model."""

from __future__ import annotations

import calendar

import pytest
import redis.asyncio as aioredis

from coderai.contracts import RequestCompleted
from coderai.metrics.usage import record, usage_keys

# 2024-02-29 23:59:59 UTC: a leap day, one second before the month turns.
TS = float(calendar.timegm((2024, 2, 29, 23, 59, 59)))


def done(key: str, **kw) -> RequestCompleted:
    base = dict(request_id="r", ts=TS, key_name=key, model="m", op="chat", status="ok", http_status=200)
    return RequestCompleted(**{**base, **kw})


@pytest.fixture
async def redis(redis_server):
    client = aioredis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


def test_usage_keys_are_per_key_day_and_month_in_utc():
    assert usage_keys(done("alice")) == ["coderai:usage:alice:day:2024-02-29", "coderai:usage:alice:month:2024-02"]
    assert usage_keys(done("alice", ts=TS + 1)) == ["coderai:usage:alice:day:2024-03-01", "coderai:usage:alice:month:2024-03"]


async def test_record_counts_requests_and_tokens_in_both_hashes(redis, unique):
    e = done(unique, prompt_tokens=12, completion_tokens=30)
    await record(redis, e)
    want = {"requests": "1", "requests:m": "1", "prompt_tokens": "12", "completion_tokens": "30", "tokens:m": "42"}
    for key in usage_keys(e):
        assert await redis.hgetall(key) == want


async def test_record_accumulates_per_model_and_counts_errors(redis, unique):
    await record(redis, done(unique, prompt_tokens=5, completion_tokens=7))
    await record(redis, done(unique, model="big", prompt_tokens=100, completion_tokens=1))
    await record(redis, done(unique, status="timeout", http_status=504, prompt_tokens=8))
    await record(redis, done(unique, model="big", status="engine_failed", http_status=502))
    day, month = usage_keys(done(unique))
    want = {
        "requests": "4", "errors": "2", "requests:m": "2", "requests:big": "2",
        "prompt_tokens": "113", "completion_tokens": "8", "tokens:m": "20", "tokens:big": "101",
    }
    assert await redis.hgetall(day) == want
    assert await redis.hgetall(month) == want


async def test_a_successful_request_adds_no_errors_field(redis, unique):
    await record(redis, done(unique))
    day, _ = usage_keys(done(unique))
    fields = await redis.hgetall(day)
    assert "errors" not in fields
    assert fields["requests"] == "1" and fields["tokens:m"] == "0"


async def test_days_split_but_the_month_accumulates(redis, unique):
    await record(redis, done(unique, ts=TS - 86400, completion_tokens=1))  # 2024-02-28
    await record(redis, done(unique, completion_tokens=2))  # 2024-02-29
    await record(redis, done(unique, ts=TS + 1, completion_tokens=4))  # 2024-03-01
    hget = redis.hget
    assert await hget(f"coderai:usage:{unique}:day:2024-02-28", "completion_tokens") == "1"
    assert await hget(f"coderai:usage:{unique}:day:2024-02-29", "completion_tokens") == "2"
    assert await hget(f"coderai:usage:{unique}:day:2024-03-01", "completion_tokens") == "4"
    assert await hget(f"coderai:usage:{unique}:month:2024-02", "requests") == "2"
    assert await hget(f"coderai:usage:{unique}:month:2024-02", "completion_tokens") == "3"
    assert await hget(f"coderai:usage:{unique}:month:2024-03", "requests") == "1"


async def test_keys_are_kept_apart(redis, unique):
    await record(redis, done(f"{unique}-a", prompt_tokens=1))
    await record(redis, done(f"{unique}-b", prompt_tokens=2))
    assert await redis.hget(usage_keys(done(f"{unique}-a"))[0], "prompt_tokens") == "1"
    assert await redis.hget(usage_keys(done(f"{unique}-b"))[0], "prompt_tokens") == "2"
