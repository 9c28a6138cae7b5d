"""A node fetches a model file it lacks from the head's store: chunk by chunk, resuming a partial file, checked
against the head's sha256 before it is used; a failed fetch fails the engine's load with a clear error."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest
from coderai.contracts import BusError, ModelConfig, StoreChunk, StoreFetch
from coderai.contracts.store import CHUNK_BYTES
from coderai.engine_worker.fetch import FetchError, ensure_local, fetch_file
from coderai.engine_worker.host import EngineHost

DATA = os.urandom(10_000)
SHA = hashlib.sha256(DATA).hexdigest()


class Head:
    """The head's side, in memory: serves `data` by range; counts what it was asked for."""

    def __init__(self, data: bytes = DATA, sha: str = SHA, corrupt_at: int | None = None) -> None:
        self.data, self.sha, self.corrupt_at = data, sha, corrupt_at
        self.asked: list[tuple[int, int]] = []

    async def __call__(self, req: StoreFetch, timeout: float) -> StoreChunk:
        if req.path != "org/repo/m.gguf":
            raise BusError("not_found", f"no file {req.path!r}")
        self.asked.append((req.offset, req.length))
        data = self.data[req.offset : req.offset + req.length]
        if self.corrupt_at is not None and req.offset <= self.corrupt_at < req.offset + len(data):
            i = self.corrupt_at - req.offset
            data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
        return StoreChunk(data=data, size=len(self.data), sha256=self.sha)


async def test_a_file_is_fetched_in_chunks_and_renamed_into_place(tmp_path):
    head = Head()
    path = await fetch_file(head, "org/repo/m.gguf", tmp_path, chunk=3000)
    assert path == tmp_path / "org" / "repo" / "m.gguf" and path.read_bytes() == DATA
    assert head.asked == [(0, 0), (0, 3000), (3000, 3000), (6000, 3000), (9000, 3000)]
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".partial")] == []
    head.asked.clear()
    assert await fetch_file(head, "org/repo/m.gguf", tmp_path, chunk=3000) == path  # already here: size only
    assert head.asked == [(0, 0)]


async def test_a_partial_file_resumes_from_its_size(tmp_path):
    partial = tmp_path / "org" / "repo" / f".m.gguf.{SHA[:16]}.partial"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(DATA[:4321])
    stale = tmp_path / "org" / "repo" / ".m.gguf.0000000000000000.partial"  # another version's: never resumed
    stale.write_bytes(b"x" * 9999)
    head = Head()
    path = await fetch_file(head, "org/repo/m.gguf", tmp_path, chunk=4000)
    assert path.read_bytes() == DATA
    assert head.asked == [(0, 0), (4321, 4000), (8321, 4000)]
    assert not partial.exists()


async def test_a_corrupted_transfer_is_rejected_and_not_kept(tmp_path):
    with pytest.raises(FetchError, match="checksum mismatch"):
        await fetch_file(Head(corrupt_at=5000), "org/repo/m.gguf", tmp_path, chunk=3000)
    folder = tmp_path / "org" / "repo"
    assert list(folder.iterdir()) == []
    # a corrupted partial left by an earlier run is caught too, and the next try starts over
    (folder / f".m.gguf.{SHA[:16]}.partial").write_bytes(b"\0" * 100)
    with pytest.raises(FetchError, match="checksum mismatch"):
        await fetch_file(Head(), "org/repo/m.gguf", tmp_path)
    assert (await fetch_file(Head(), "org/repo/m.gguf", tmp_path)).read_bytes() == DATA


async def test_a_file_changed_on_the_head_mid_fetch_fails(tmp_path):
    head = Head()
    calls = 0

    async def changing(req: StoreFetch, timeout: float) -> StoreChunk:
        nonlocal calls
        calls += 1
        out = await head(req, timeout)
        return out if calls < 3 else StoreChunk(data=out.data, size=out.size, sha256="0" * 64)

    with pytest.raises(FetchError, match="changed on the head"):
        await fetch_file(changing, "org/repo/m.gguf", tmp_path, chunk=1000)
    assert list((tmp_path / "org" / "repo").iterdir()) == []


async def test_a_local_copy_that_differs_from_the_heads_is_fetched_again(tmp_path):
    dest = tmp_path / "org" / "repo" / "m.gguf"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"y" * len(DATA))  # same size, other bytes
    assert (await fetch_file(Head(), "org/repo/m.gguf", tmp_path)).read_bytes() == DATA


async def test_bad_store_paths_and_a_missing_head_file(tmp_path):
    for bad in ("../escape.gguf", "/abs.gguf", "a/../../b"):
        with pytest.raises(FetchError):
            await fetch_file(Head(), bad, tmp_path)
    with pytest.raises(FetchError, match="not_found"):
        await fetch_file(Head(), "org/repo/other.gguf", tmp_path)


async def test_ensure_local_only_fetches_what_is_missing(tmp_path):
    here = tmp_path / "here.gguf"
    here.write_bytes(b"x")
    head = Head()
    cfg = ModelConfig(name="m", engine="llama", path=str(here), store_path="org/repo/m.gguf")
    assert await ensure_local(cfg, head, tmp_path / "models") is cfg
    assert head.asked == []
    no_store = ModelConfig(name="m", engine="llama", path="/nowhere/m.gguf")
    assert await ensure_local(no_store, head, tmp_path / "models") is no_store
    away = ModelConfig(name="m", engine="llama", path="/nowhere/m.gguf", store_path="org/repo/m.gguf")
    got = await ensure_local(away, head, tmp_path / "models")
    assert got.path == str(tmp_path / "models" / "org" / "repo" / "m.gguf") and got.store_path == away.store_path


async def test_two_engines_of_one_model_fetch_it_once(tmp_path):
    head = Head()
    away = ModelConfig(name="m", engine="llama", path="/nowhere/m.gguf", store_path="org/repo/m.gguf")
    a, b = await asyncio.gather(
        ensure_local(away, head, tmp_path / "models"), ensure_local(away, head, tmp_path / "models")
    )
    assert a.path == b.path and Path(a.path).read_bytes() == DATA
    assert [n for _, n in head.asked if n] == [CHUNK_BYTES]  # the bytes once; the second only asked for the size


async def test_a_failed_fetch_fails_the_engine_with_a_clear_error(tmp_path):
    class NoHead:
        async def request(self, *_a, **_kw):
            raise BusError("no_engine", "nobody serves coderai.cmd.store.fetch", retryable=True)

    cfg = ModelConfig(name="m", engine="llama", path="/nowhere/m.gguf", store_path="org/repo/m.gguf")
    host = EngineHost(NoHead(), "n1", cfg, 1.0, models_dir=tmp_path)
    assert await host.load() is False
    st = host.status()
    assert st.state == "failed" and "cannot fetch org/repo/m.gguf from the head's model store" in (st.error or "")
    assert host.config is cfg
