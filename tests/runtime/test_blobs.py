"""Blobs against a real nats-server: small ones stay inline, big ones go through the object store and back."""

from __future__ import annotations

import os

import pytest

from coderai.contracts import Blob, ImageResult, TranscribeJob, encode
from coderai.runtime.blobs import BlobMissing, BlobStore
from coderai.runtime.bus import Bus


async def test_small_blobs_stay_inline_and_big_ones_are_stored(bus):
    store = BlobStore(bus, create=True, inline_max=1000)
    small, big = os.urandom(600), os.urandom(300_000)
    job = TranscribeJob(request_id="r", model="m", audio=Blob(data=big, size=len(big), content_type="audio/wav"))
    packed = await store.pack(job)
    assert packed.audio.data == b"" and packed.audio.name and packed.audio.content_type == "audio/wav"
    assert len(encode(packed)) < 1000  # the message itself stays small
    assert (await store.unpack(packed)).audio.data == big

    images = ImageResult(images=[Blob(data=small), Blob(data=small)])
    out = await store.pack(images)  # the budget is for the whole message: the second one goes to the store
    assert out.images[0].data == small and out.images[1].name and not out.images[1].data
    assert [b.data for b in (await store.unpack(out)).images] == [small, small]


async def test_a_node_binds_the_bucket_the_gateway_created(bus, nats_server):
    await BlobStore(bus, create=True).store()
    other = await Bus.connect(nats_server.url, "node")
    try:
        stored = await BlobStore(bus).put(b"x" * 10, suffix=".png")
        assert stored.name.endswith(".png")
        assert await BlobStore(other).get(stored) == b"x" * 10
    finally:
        await other.close()


async def test_a_missing_blob_is_a_clear_error(bus):
    store = BlobStore(bus, create=True)
    with pytest.raises(BlobMissing):
        await store.get(Blob(name="no-such-object"))
