"""Reading whole KV buckets (`kv.read_all`, `kv.list_keys`) and binding object stores (`Bus.object_store`), against
a real nats-server."""

from __future__ import annotations

import asyncio

import logging

import msgspec
import pytest
from nats.js.errors import BucketNotFoundError

from coderai.contracts import encode
from coderai.contracts.topology import BucketSpec
from coderai.runtime.bus import Bus
from coderai.runtime.kv import list_keys, read_all


class Rec(msgspec.Struct, frozen=True):
    n: int


async def test_an_empty_bucket_reads_as_nothing(bus, unique):
    kv = await bus.kv(BucketSpec(f"test_{unique}"))
    assert await read_all(kv, Rec) == {}
    assert await list_keys(kv) == []


async def test_read_all_decodes_every_key_or_those_with_the_prefix(bus, unique):
    kv = await bus.kv(BucketSpec(f"test_{unique}"))
    for key, n in (("job-a", 1), ("job-b", 2), ("other", 3)):
        await kv.put(key, encode(Rec(n=n)))
    assert await read_all(kv, Rec) == {"job-a": Rec(1), "job-b": Rec(2), "other": Rec(3)}
    assert await read_all(kv, Rec, prefix="job-") == {"job-a": Rec(1), "job-b": Rec(2)}
    assert await read_all(kv, Rec, prefix="none-") == {}
    assert sorted(await list_keys(kv, prefix="job-")) == ["job-a", "job-b"]


async def test_values_that_do_not_decode_are_skipped_and_logged(bus, unique, caplog):
    kv = await bus.kv(BucketSpec(f"test_{unique}"))
    await kv.put("good", encode(Rec(n=1)))
    await kv.put("not-json", b"{not json")
    await kv.put("wrong-type", b'{"n": "one"}')
    with caplog.at_level(logging.DEBUG, logger="coderai.kv"):
        assert await read_all(kv, Rec) == {"good": Rec(1)}
    skipped = " ".join(r.getMessage() for r in caplog.records if r.name == "coderai.kv")
    assert "not-json" in skipped and "wrong-type" in skipped


async def test_deleted_keys_are_left_out(bus, unique):
    kv = await bus.kv(BucketSpec(f"test_{unique}"))
    for key in ("a", "b", "c"):
        await kv.put(key, encode(Rec(n=1)))
    await kv.delete("a")  # deleted before the listing: not listed at all
    assert set(await read_all(kv, Rec)) == {"b", "c"}


class _DeletesAfterListing:
    """The real bucket, with `key` deleted by another writer after the keys were listed, before any is read."""

    def __init__(self, kv, key: str) -> None:
        self.kv, self.key = kv, key
        self.deleting: asyncio.Task | None = None

    def __getattr__(self, name: str):  # the listing reads the real bucket's stream
        return getattr(self.kv, name)

    async def get(self, key: str):
        if self.deleting is None:
            self.deleting = asyncio.ensure_future(self.kv.delete(self.key))
        await self.deleting
        return await self.kv.get(key)


async def test_a_key_deleted_between_listing_and_reading_is_left_out(bus, unique):
    kv = await bus.kv(BucketSpec(f"test_{unique}"))
    for key in ("a", "b"):
        await kv.put(key, encode(Rec(n=1)))
    assert await read_all(_DeletesAfterListing(kv, "a"), Rec) == {"b": Rec(1)}
    emptied = _DeletesAfterListing(kv, "b")  # the last key goes: an empty bucket by the time it is read
    assert await read_all(emptied, Rec) == {}


async def test_object_store_created_with_its_spec_then_bound(bus, nats_server, unique):
    spec = BucketSpec(f"test_obs_{unique}", ttl_s=120, description="test objects")
    with pytest.raises(BucketNotFoundError):  # missing and not asked to create: nats-py's own error
        await bus.object_store(spec)
    made = await bus.object_store(spec, create=True, max_bytes=1 << 20)
    try:
        status = await made.status()
        cfg = status.stream_info.config
        assert (status.description, cfg.max_age, cfg.max_bytes) == ("test objects", 120, 1 << 20)
        await made.put("x", b"hello")
        other = await Bus.connect(nats_server.url, "other")
        try:
            bound = await other.object_store(spec)  # it exists now: bound, no create needed
            assert (await bound.get("x")).data == b"hello"
            again = await other.object_store(spec, create=True, max_bytes=1 << 21)  # exists: bound as it is
            assert (await again.status()).stream_info.config.max_bytes == 1 << 20
        finally:
            await other.close()
    finally:
        await bus.js.delete_object_store(spec.name)


async def test_object_store_without_a_ttl_or_cap_keeps_everything(bus, unique):
    spec = BucketSpec(f"test_obs_{unique}", description="kept until deleted")  # as FILES
    made = await bus.object_store(spec, create=True)
    try:
        cfg = (await made.status()).stream_info.config
        assert not cfg.max_age and cfg.max_bytes in (None, -1)
    finally:
        await bus.js.delete_object_store(spec.name)
