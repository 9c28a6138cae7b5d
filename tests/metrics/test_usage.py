"""Usage per key x model x day in the session's real Redis."""

from __future__ import annotations

import time
import uuid

import pytest

from coderai.contracts import RequestCompleted
from coderai.accounts.usage import day_of, increments, read, record, record_many


def ev(
    key: str,
    model: str = "m",
    status: str = "ok",
    p: int = 10,
    c: int = 5,
    ts: float | None = None,
    duration: float = 0.25,
    cost: float = 0.0,
) -> RequestCompleted:
    return RequestCompleted(
        request_id=uuid.uuid4().hex,
        ts=ts or time.time(),
        key_name=key,
        model=model,
        op="chat",
        status=status,
        http_status=200 if status == "ok" else 502,
        prompt_tokens=p,
        completion_tokens=c,
        duration_s=duration,
        cost_usd=cost,
    )


def test_increments_sum_per_day_key_and_model():
    day = day_of(time.time())
    rows = increments([ev("a"), ev("a", status="engine_failed"), ev("a", model="n"), ev("b", p=1, c=1, cost=0.5)])
    assert rows[(day, "a", "m")] == {
        "requests": 2,
        "errors": 1,
        "prompt_tokens": 20,
        "completion_tokens": 10,
        "wall_ms": 500,
        "cost_micro_usd": 0,
    }
    assert rows[(day, "a", "n")]["requests"] == 1
    assert rows[(day, "b", "m")]["cost_micro_usd"] == 500_000


def test_events_on_two_days_land_in_two_rows():
    t = time.mktime((2026, 11, 28, 23, 59, 0, 0, 0, 0))
    rows = increments([ev("a", ts=t), ev("a", ts=t + 120)])
    assert len(rows) == 2


async def test_record_and_read_back(r, unique):
    key = f"k{unique}"
    await record_many(r, [ev(key), ev(key, model="other", p=3, c=4, cost=0.001), ev(key, status="timeout")])
    await record(r, ev(key))
    day = day_of(time.time())
    rows = await read(r, [day], key=key)
    assert [(x["model"], x["requests"]) for x in rows] == [("m", 3), ("other", 1)]
    m = rows[0]
    assert (m["errors"], m["prompt_tokens"], m["completion_tokens"], m["wall_ms"]) == (1, 30, 15, 750)
    assert rows[1]["cost_usd"] == pytest.approx(0.001)
    assert await read(r, [day], key=key, model="other") == rows[1:]
    assert await read(r, ["1999-01-01"], key=key) == []


async def test_a_batch_delivered_again_is_not_counted_twice(r, unique):
    """The metrics service records a batch, then its ack is lost (NATS restarting): the same events come again,
    with the same stream sequences, and only those past the mark count."""
    from coderai.accounts.usage import record_new

    key, mark = f"k{unique}", f"coderai:usage:applied:test:{unique}"
    first = [(1, ev(key)), (2, ev(key, p=1, c=1))]
    assert len(await record_new(r, first, mark)) == 2
    again = [*first, (3, ev(key, status="timeout"))]  # redelivered, with one new event behind it
    fresh = await record_new(r, again, mark)
    assert [e.status for e in fresh] == ["timeout"]
    assert await record_new(r, again, mark) == []
    row = (await read(r, [day_of(time.time())], key=key))[0]
    assert (row["requests"], row["errors"], row["prompt_tokens"], row["completion_tokens"]) == (3, 1, 21, 11)
    assert int(await r.get(mark)) == 3


async def test_an_event_stored_twice_in_the_stream_is_counted_once(r, unique):
    """Attack on billing: a dead gateway's journal is replayed after EVENTS' 2-minute duplicate window, so the
    stream stores its event a second time, under a new sequence. Usage is deduplicated by request id too."""
    from coderai.accounts.usage import record_new

    key, mark = f"k{unique}", f"coderai:usage:applied:test:{unique}"
    once = ev(key, p=7, c=3)
    assert len(await record_new(r, [(1, once)], mark)) == 1
    assert await record_new(r, [(2, once), (3, once)], mark) == []  # past the mark, but its id was counted
    row = (await read(r, [day_of(time.time())], key=key))[0]
    assert (row["requests"], row["prompt_tokens"]) == (1, 7)
    print("one request's event stored three times in the stream: counted once")


async def test_a_mark_behind_what_its_writer_stored_is_a_loss_and_records_nothing(r, unique):
    """Redis' mark only moves forward. Below what the caller saw it store (a replica promoted before the last
    batches reached it), or gone, usage is lost: MarkLost, and the batch is not recorded on top of the loss."""
    from coderai.accounts.usage import MarkLost, record_new

    key, mark = f"k{unique}", f"coderai:usage:applied:test:{unique}"
    assert len(await record_new(r, [(1, ev(key)), (2, ev(key))], mark)) == 2
    await r.set(mark, 1)  # the promoted replica had the first event only
    with pytest.raises(MarkLost):
        await record_new(r, [(3, ev(key))], mark, stored_up_to=2)
    await r.delete(mark)
    with pytest.raises(MarkLost):
        await record_new(r, [(3, ev(key))], mark, stored_up_to=2)
    assert (await read(r, [day_of(time.time())], key=key))[0]["requests"] == 2
    assert len(await record_new(r, [(3, ev(key))], mark, stored_up_to=0)) == 1  # a first batch: no mark needed
