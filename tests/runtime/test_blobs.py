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


async def test_a_cap_the_disk_cannot_hold_is_halved_until_it_fits(tmp_path):
    """On a small disk nats-server refuses the blob store's 4 GiB default (over 75 % of the free space): the store
    is made with a cap that fits instead of not at all."""
    import os

    from coderai.contracts.topology import BLOBS
    from coderai.runtime.bus import Bus
    from coderai.runtime.embedded import NatsServer
    from coderai.testing.faults import Tmpfs
    from coderai.testing.netns import NetnsUnavailable

    if os.geteuid() != 0:
        pytest.skip("mounting a small disk needs root")
    try:
        disk = Tmpfs(tmp_path / "disk", size_mb=512)
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    server = NatsServer(disk.path / "nats").start()
    try:
        bus = await Bus.connect(server.url, "test")
        try:
            store = await bus.object_store(BLOBS, create=True, max_bytes=4 << 30)
            cap = (await store.status()).stream_info.config.max_bytes
            assert 64 << 20 <= cap <= 384 << 20  # halved from 4 GiB until under the server's limit
            await store.put("x", b"hello")
            assert (await store.get("x")).data == b"hello"
        finally:
            await bus.close()
    finally:
        server.stop()
        disk.close()


async def test_a_node_cannot_fill_the_gateways_memory_with_unfinished_uploads():
    """Attack: a node opens many blob uploads and never sends their last piece (16 x 32 MB took +520 MB of gateway
    memory in 6 s). Unfinished uploads are bounded per sender (its inbox says who it is) and in all."""
    from types import SimpleNamespace

    from coderai.contracts import BusError
    from coderai.contracts.media import BlobWrite
    from coderai.runtime.blobs import BlobService

    svc = BlobService(None)  # no store: nothing here finishes an upload
    evil, good = SimpleNamespace(reply="_N.evil.abc"), SimpleNamespace(reply="_N.good.def")
    piece = b"x" * (1 << 20)
    refused = 0
    tried = BlobService.MAX_OPEN_PER_SENDER + 8
    for i in range(tried):
        try:
            await svc.write(BlobWrite(upload=f"u{i}", offset=0, data=piece, last=False), evil)
        except BusError as exc:
            assert exc.code == "busy"
            refused += 1
    assert refused == 8
    await svc.write(BlobWrite(upload="g0", offset=0, data=piece, last=False), good)  # another node is not refused
    await svc.write(BlobWrite(upload="u0", offset=len(piece), data=piece, last=False), evil)  # its own go on
    svc.MAX_OPEN_BYTES = (BlobService.MAX_OPEN_PER_SENDER + 3) << 20  # 18 MiB are open now
    try:
        with pytest.raises(BusError):
            await svc.write(BlobWrite(upload="g1", offset=0, data=piece * 2, last=False), good)
    finally:
        del svc.MAX_OPEN_BYTES
    print(f"{tried} unfinished uploads from one node: {refused} refused; another node's still taken")
