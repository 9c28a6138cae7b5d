"""`KVMirror` on a real bucket: a bounded mirror keeps the keys written last, and `shrink` maps what it keeps."""

from __future__ import annotations

import asyncio
import sys

import msgspec

from coderai.contracts import encode
from coderai.contracts.topology import BucketSpec
from coderai.runtime.lifecycle import wait_for
from coderai.runtime.mirror import KVMirror


class Rec(msgspec.Struct, frozen=True):
    owner: str
    n: int


async def test_a_bounded_mirror_keeps_the_keys_written_last(bus, unique):
    mirror = KVMirror(bus, BucketSpec(f"test_{unique}"), Rec, max_entries=16)
    kv = await mirror.bind()
    mirror.start()
    try:
        for i in range(40):
            await kv.put(f"k{i}", encode(Rec(owner="a", n=i)))
        await wait_for(lambda: "k39" in mirror.values, 10, what="the last write")
        kept = list(mirror.values)
        # the bound is let past by a sixteenth before the oldest are dropped, then cut back to it
        assert 16 <= len(kept) <= 17 and kept[-1] == "k39"
        assert kept == [f"k{i}" for i in range(40 - len(kept), 40)], "the oldest were dropped first"
        assert mirror.evicted == 40 - len(kept)
        assert set(mirror.revisions) == set(kept), "a dropped key's revision goes with it"
        assert len(await kv.keys()) == 40, "dropped from memory, not from the bucket"

        oldest = kept[0]  # written again, it is the newest and outlives keys written after it first
        await kv.put(oldest, encode(Rec(owner="a", n=100)))
        for i in range(40, 50):
            await kv.put(f"k{i}", encode(Rec(owner="a", n=i)))
        await wait_for(lambda: "k49" in mirror.values, 10, what="the last write")
        assert mirror.values[oldest] == Rec(owner="a", n=100)
        assert kept[1] not in mirror.values
    finally:
        mirror.stop()


async def test_an_unbounded_mirror_keeps_everything_and_shrink_maps_each_value(bus, unique):
    def shared(r: Rec) -> Rec:
        return Rec(owner=sys.intern(r.owner), n=r.n)

    mirror = KVMirror(bus, BucketSpec(f"test_{unique}"), Rec, shrink=shared)
    kv = await mirror.bind()
    mirror.start()
    try:
        owner = "".join(["node-", unique])  # made at run time, so only shrink can make the copies one
        for i in range(300):
            await kv.put(f"k{i}", encode(Rec(owner=owner, n=i)))
        await wait_for(lambda: len(mirror.values) == 300, 10, what="every key")
        assert mirror.evicted == 0
        owners = {id(r.owner) for r in mirror.values.values()}
        assert len(owners) == 1, "every value holds the one copy of its owner"
    finally:
        mirror.stop()


async def test_a_restarted_watch_reads_only_what_changed_and_all_again_after_a_wiped_store(bus, unique):
    spec = BucketSpec(f"test_{unique}")
    mirror = KVMirror(bus, spec, Rec)
    kv = await mirror.bind()
    applied: list[str] = []
    apply = mirror._apply
    mirror._apply = lambda e: (applied.append(e.key), apply(e))
    mirror.start()
    try:
        for i in range(50):
            await kv.put(f"k{i}", encode(Rec(owner="a", n=i)))
        await wait_for(lambda: len(mirror.values) == 50, 10, what="every key")
        await kv.put("k3", encode(Rec(owner="b", n=3)))
        await kv.delete("k4")
        applied.clear()
        mirror.start()  # what a service does after a reconnect
        await kv.put("k5", encode(Rec(owner="c", n=5)))
        await wait_for(lambda: mirror.values.get("k5") == Rec(owner="c", n=5), 10, what="the change after the restart")
        assert mirror.values["k3"] == Rec(owner="b", n=3) and "k4" not in mirror.values
        assert len(applied) <= 3, f"the restarted watch read the bucket again: {len(applied)} entries"

        await bus.js.delete_key_value(spec.name)  # the server's store is wiped: its sequences start again
        kv = await bus.kv(spec)
        mirror.kv = kv
        for i in range(60):  # past the old revisions: only the stream's creation time tells it is another
            await kv.put("fresh", encode(Rec(owner="d", n=i)))
        mirror.start()
        await wait_for(
            lambda: list(mirror.values) == ["fresh"] and mirror.values["fresh"].n == 59,
            10,
            what="the whole (new) bucket, and nothing from before",
        )
    finally:
        mirror.stop()


async def test_current_tells_a_whole_view_from_one_being_rebuilt(bus, unique):
    """`current` is set once the replay is done, cleared while a restarted watch catches up (a reader must not take
    a key it lacks then for absent), and set again once it has; a bucket made anew forgets what was read before,
    telling `on_change`, while `current` is clear."""
    spec = BucketSpec(f"test_{unique}")
    changes: list[tuple[str, Rec | None]] = []
    mirror = KVMirror(bus, spec, Rec, on_change=lambda k, v: changes.append((k, v)))
    kv = await mirror.bind()
    for i in range(5):
        await kv.put(f"k{i}", encode(Rec(owner="a", n=i)))
    mirror.start()
    try:
        assert not mirror.current.is_set()
        await wait_for(mirror.current.is_set, 10, what="the replay")
        assert len(mirror.values) == 5 and mirror.synced.is_set()

        caught_up: list[int] = []  # how many keys the view held each time it said it was current again
        mirror.current.clear()
        await kv.put("k9", encode(Rec(owner="b", n=9)))  # changed while the watch was away
        mirror.start()  # a reconnect
        assert not mirror.current.is_set(), "current before the restarted watch caught up"
        await mirror.current.wait()
        caught_up.append(len(mirror.values))
        assert caught_up == [6] and mirror.values["k9"].n == 9

        mirror.start()  # nothing changed while away: current again at once the catch-up finds nothing pending
        await wait_for(mirror.current.is_set, 10, what="an idle catch-up")

        await bus.js.delete_key_value(spec.name)  # wiped: read whole again, and what was read before is forgotten
        kv = await bus.kv(spec)
        mirror.kv = kv
        for i in range(40):
            await kv.put("fresh", encode(Rec(owner="d", n=i)))
        changes.clear()
        mirror.start()
        await wait_for(lambda: mirror.current.is_set() and list(mirror.values) == ["fresh"], 10, what="the new bucket")
        assert {k for k, v in changes if v is None} == {f"k{i}" for i in range(5)} | {"k9"}
    finally:
        mirror.stop()


async def test_the_mirror_is_whole_only_once_the_replay_is_done_even_if_the_end_marker_comes_first(bus, unique):
    """nats-py's end-of-replay marker can come before the replay's entries (nats-io/nats.py#842): a mirror that
    trusted it was called current with keys missing, and a model that existed read as absent (a wrong 404). The
    marker is given first here, before every entry: current must still mean every key is there."""
    mirror = KVMirror(bus, BucketSpec(f"test_{unique}"), Rec)
    kv = await mirror.bind()
    for i in range(50):
        await kv.put(f"k{i}", encode(Rec(owner="a", n=i)))
    watch = kv.watch
    past_marker, release = asyncio.Event(), asyncio.Event()

    async def marker_first(*args, **kwargs):
        watcher = await watch(*args, **kwargs)
        updates, early = watcher.updates, [None]

        async def first_the_marker(timeout=5.0):
            if early:
                return early.pop()
            past_marker.set()  # the mirror has taken the marker and asks for more: the entries wait till released
            await release.wait()
            return await updates(timeout)

        watcher.updates = first_the_marker
        return watcher

    kv.watch = marker_first
    mirror.start()
    try:
        await asyncio.wait_for(past_marker.wait(), 10)
        assert not mirror.current.is_set(), "called current at the marker, before any entry of the replay"
        release.set()
        await wait_for(mirror.current.is_set, 10, what="the mirror current")
        assert len(mirror.values) == 50, f"current with {len(mirror.values)} of 50 keys"
        await kv.put("k50", encode(Rec(owner="a", n=50)))  # and it follows the bucket after the replay
        await wait_for(lambda: "k50" in mirror.values, 10, what="a write after the replay")
    finally:
        mirror.stop()


async def test_a_listing_is_read_from_the_stream_not_nats_pys_watcher(bus, unique, monkeypatch):
    """`list_keys`/`read_all` do not go through nats-py's `keys()` (its watcher can end the listing early: CI read
    a bucket of placements as empty). Made to fail here, it is not asked; every live key is listed, a deleted one
    is not, past one page of gets."""
    from coderai.runtime.kv import list_keys, read_all

    kv = await bus.kv(BucketSpec(f"test_{unique}"))
    for i in range(150):
        await kv.put(f"k{i}", encode(Rec(owner="a", n=i)))
    await kv.delete("k7")

    async def short(*_a, **_k):
        raise AssertionError("nats-py's keys() was asked")

    monkeypatch.setattr(kv, "keys", short)
    assert sorted(await list_keys(kv)) == sorted(f"k{i}" for i in range(150) if i != 7)
    assert sorted(await list_keys(kv, prefix="k1")) == sorted(f"k{i}" for i in range(150) if str(i).startswith("1"))
    got = await read_all(kv, Rec)
    assert len(got) == 149 and got["k149"] == Rec(owner="a", n=149) and "k7" not in got


async def test_a_batchs_answers_are_all_read_even_if_the_end_marker_comes_first(bus, unique):
    """A stressed fresh run finished a three-line batch with 0 completed: its answers were read by a watch that
    stopped at nats-py's early end marker. Given first here, the marker no longer ends the read."""
    import msgspec

    from coderai.gateway.batches.records import LineResult, each_line, line_key

    kv = await bus.kv(BucketSpec(f"test_{unique}"))
    for i in range(3):
        await kv.put(
            line_key("batch_x", i),
            msgspec.json.encode(LineResult(index=i, custom_id=f"r{i}", id=f"l{i}", request_id="q", status_code=200)),
        )
    watch = kv.watch

    async def marker_first(*args, **kwargs):
        watcher = await watch(*args, **kwargs)
        updates, early = watcher.updates, [None]

        async def first_the_marker(timeout=5.0):
            return early.pop() if early else await updates(timeout)

        watcher.updates = first_the_marker
        return watcher

    kv.watch = marker_first
    got: list = []
    await each_line(kv, "batch_x", got.append)
    assert sorted(r.custom_id for r in got) == ["r0", "r1", "r2"]
