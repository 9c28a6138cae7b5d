"""Per-key usage counters in Redis, by day and by month: one pipeline per batch of events, increments summed
in memory first (a batch of a thousand requests by one key is a dozen HINCRBYs, not twelve thousand)."""

from __future__ import annotations

import time

from coderai.contracts import RequestCompleted


def usage_keys(e: RequestCompleted) -> list[str]:
    day = time.strftime("%Y-%m-%d", time.gmtime(e.ts))
    month = day[:7]
    return [f"coderai:usage:{e.key_name}:day:{day}", f"coderai:usage:{e.key_name}:month:{month}"]


def increments(events: list[RequestCompleted]) -> dict[tuple[str, str], int]:
    """(hash key, field) -> amount: requests, errors and tokens, overall and per model, per day and month."""
    out: dict[tuple[str, str], int] = {}

    def add(key: str, field: str, n: int) -> None:
        out[(key, field)] = out.get((key, field), 0) + n

    for e in events:
        for key in usage_keys(e):
            add(key, "requests", 1)
            add(key, f"requests:{e.model}", 1)
            if e.status != "ok":
                add(key, "errors", 1)
            add(key, "prompt_tokens", e.prompt_tokens)
            add(key, "completion_tokens", e.completion_tokens)
            add(key, f"tokens:{e.model}", e.prompt_tokens + e.completion_tokens)
    return out


async def record_many(redis, events: list[RequestCompleted]) -> None:
    """HINCRBY every summed increment of the batch in one pipeline."""
    pipe = redis.pipeline(transaction=False)
    for (key, field), n in increments(events).items():
        pipe.hincrby(key, field, n)
    await pipe.execute()


async def record(redis, e: RequestCompleted) -> None:
    """One event's usage (see `record_many`)."""
    await record_many(redis, [e])
