"""Per key x model x day usage in Redis, summed per batch of events into one pipeline.

    coderai:usage:<YYYY-MM-DD>:<key>:<model>  hash: requests, errors, prompt_tokens, completion_tokens,
                                              wall_ms, cost_micro_usd
    coderai:usage:index:<YYYY-MM-DD>          set of "<key>\\t<model>" that have a hash that day
    coderai:usage:seen:<YYYY-MM-DD>           set of the request ids counted for that day (kept SEEN_DAYS)

A batch of a thousand requests by one key and model is six HINCRBYs, not six thousand. Audio seconds, images
and attributed pod spend join the hash with the modalities and the pod broker that produce them.
"""

from __future__ import annotations

import time

from coderai.contracts import RequestCompleted

FIELDS = ("requests", "errors", "prompt_tokens", "completion_tokens", "wall_ms", "cost_micro_usd")


def day_of(ts: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(ts))


def usage_key(day: str, key_name: str, model: str) -> str:
    return f"coderai:usage:{day}:{key_name}:{model}"


def increments(events: list[RequestCompleted]) -> dict[tuple[str, str, str], dict[str, int]]:
    """(day, key, model) -> field -> amount."""
    out: dict[tuple[str, str, str], dict[str, int]] = {}
    for e in events:
        row = out.setdefault((day_of(e.ts), e.key_name, e.model), dict.fromkeys(FIELDS, 0))
        row["requests"] += 1
        row["errors"] += e.status != "ok"
        row["prompt_tokens"] += e.prompt_tokens
        row["completion_tokens"] += e.completion_tokens
        row["wall_ms"] += round(e.duration_s * 1000)
        row["cost_micro_usd"] += round(e.cost_usd * 1e6)
    return out


def _queue(pipe, events: list[RequestCompleted]) -> None:
    """HINCRBY every summed field of the batch, and index the rows, on `pipe`."""
    for (day, key, model), row in increments(events).items():
        hkey = usage_key(day, key, model)
        for field, n in row.items():
            if n:
                pipe.hincrby(hkey, field, n)
        pipe.sadd(f"coderai:usage:index:{day}", f"{key}\t{model}")


async def record_many(redis, events: list[RequestCompleted]) -> None:
    """The batch's usage in one pipeline."""
    pipe = redis.pipeline(transaction=False)
    _queue(pipe, events)
    await pipe.execute()


SEEN_DAYS = 8
"""How long a request id counted is remembered: an event sent again within it (a dead gateway's journal replayed
after EVENTS' 2-minute duplicate window, so stored twice in the stream) is counted once. An event older than this
at its replay is counted as it comes."""


def seen_key(day: str) -> str:
    return f"coderai:usage:seen:{day}"


class MarkLost(Exception):
    """The mark a consumer wrote is gone or behind what it wrote: Redis was replaced or emptied, or a replica that
    had not yet received the last batches was promoted (Sentinel's failover; replication is asynchronous), and the
    usage counted with them is gone too."""


BATCH_STAMP_TTL_S = 86400


def batch_stamp(mark: str, top: int) -> str:
    """Where the writer of the batch that moved `mark` to `top` is kept (`record_new`'s `writer`)."""
    return f"{mark}:by:{top}"


async def stored_by(redis, mark: str, top: int) -> str:
    """The `writer` that recorded the batch ending at EVENTS sequence `top`; '' if none said (or a day passed)."""
    got = await redis.get(batch_stamp(mark, top))
    return (got.decode() if isinstance(got, bytes) else got) or ""


async def record_new(
    redis, events: list[tuple[int, RequestCompleted]], mark: str, stored_up_to: int = 0, writer: str = ""
) -> list[RequestCompleted]:
    """Record the events (each with its EVENTS stream sequence) past the sequence stored at `mark`, and move the
    mark, in one transaction: a batch delivered again (its ack lost to a NATS restart after Redis took it) is not
    counted twice. The events recorded, which Prometheus then counts too. `stored_up_to`: the mark the caller saw
    stored last (0: none), so a mark absent or below it is MarkLost (nothing recorded): usage counted up to there
    is gone, not a first batch's. A mark only moves forward, so going back is never another consumer. `writer`: kept with the batch for a
    day (`stored_by`), so a caller whose answer was lost can tell its own stored batch from another's."""
    from redis.exceptions import WatchError

    while True:
        async with redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(mark)  # another consumer moving the mark meanwhile makes this try again
                stored = await pipe.get(mark)
                done = int(stored or 0)
                if done < stored_up_to:
                    raise MarkLost(mark)
                fresh = [e for seq, e in events if seq > done]
                fresh = await _unseen(pipe, fresh)  # by request id too: a replay past the stream's window
                top = max((seq for seq, _e in events), default=0)
                pipe.multi()
                _queue(pipe, fresh)
                _remember(pipe, fresh)
                if top > done:
                    pipe.set(mark, top)
                    if writer:
                        pipe.set(batch_stamp(mark, top), writer, ex=BATCH_STAMP_TTL_S)
                await pipe.execute()
                return fresh
            except WatchError:
                continue


async def _unseen(pipe, events: list[RequestCompleted]) -> list[RequestCompleted]:
    """`events` less those whose request id was counted already (and repeats within the batch)."""
    by_day: dict[str, list[RequestCompleted]] = {}
    out, ids = [], set()
    for e in events:
        if e.request_id:
            by_day.setdefault(day_of(e.ts), []).append(e)
        else:  # no id to tell it by: counted
            out.append(e)
    for day, group in by_day.items():
        counted = await pipe.smismember(seen_key(day), [e.request_id for e in group])
        for e, was in zip(group, counted):
            if not was and e.request_id not in ids:
                ids.add(e.request_id)
                out.append(e)
    return out


def _remember(pipe, events: list[RequestCompleted]) -> None:
    days: dict[str, list[str]] = {}
    for e in events:
        if e.request_id:
            days.setdefault(day_of(e.ts), []).append(e.request_id)
    for day, ids in days.items():
        pipe.sadd(seen_key(day), *ids)
        pipe.expire(seen_key(day), SEEN_DAYS * 86400)


async def record(redis, e: RequestCompleted) -> None:
    """One event's usage (see `record_many`)."""
    await record_many(redis, [e])


async def read(redis, days: list[str], key: str = "", model: str = "") -> list[dict]:
    """Rows for the given days, optionally one key and/or one model, ordered by day, key, model."""
    rows = []
    for day in days:
        members = sorted(
            m.decode() if isinstance(m, bytes) else m for m in await redis.smembers(f"coderai:usage:index:{day}")
        )
        for member in members:
            k, m = member.split("\t", 1)
            if (key and k != key) or (model and m != model):
                continue
            h = await redis.hgetall(usage_key(day, k, m))
            vals = {(f.decode() if isinstance(f, bytes) else f): int(v) for f, v in h.items()}
            row = {"day": day, "key": k, "model": m, **{f: vals.get(f, 0) for f in FIELDS}}
            row["cost_usd"] = row.pop("cost_micro_usd") / 1e6
            rows.append(row)
    return rows
