"""Per-key usage counters in Redis, by day and by month: one pipeline per event."""

from __future__ import annotations

import time

from coderai.contracts import RequestCompleted


def usage_keys(e: RequestCompleted) -> list[str]:
    day = time.strftime("%Y-%m-%d", time.gmtime(e.ts))
    month = day[:7]
    return [f"coderai:usage:{e.key_name}:day:{day}", f"coderai:usage:{e.key_name}:month:{month}"]


async def record(redis, e: RequestCompleted) -> None:
    """HINCRBY requests, errors and tokens, overall and per model, under the key's day and month hashes."""
    pipe = redis.pipeline(transaction=False)
    for key in usage_keys(e):
        pipe.hincrby(key, "requests", 1)
        pipe.hincrby(key, f"requests:{e.model}", 1)
        if e.status != "ok":
            pipe.hincrby(key, "errors", 1)
        pipe.hincrby(key, "prompt_tokens", e.prompt_tokens)
        pipe.hincrby(key, "completion_tokens", e.completion_tokens)
        pipe.hincrby(key, f"tokens:{e.model}", e.prompt_tokens + e.completion_tokens)
    await pipe.execute()
