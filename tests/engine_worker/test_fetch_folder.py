"""A node fetches a model FOLDER it lacks from the head's store: listed first, then file by file with the single-file
machinery (resume, sha256 check, sidecar); the folder is used only once every file is verified. The head here is
the real store code (`coderai.scheduler.store.StoreFiles`) over a temporary folder, called in memory."""

from __future__ import annotations

import hashlib
import os

import msgspec
import pytest
from coderai.contracts import (
    BusError,
    ModelConfig,
    StoreChunk,
    StoreEntry,
    StoreFetch,
    StoreList,
    StoreListing,
)
from coderai.engine_worker.fetch import FetchError, ensure_local, fetch_folder
from coderai.scheduler.store import StoreFiles

FILES = {
    "en/v.onnx": os.urandom(9_000),
    "en/v.onnx.json": b'{"audio": {"sample_rate": 22050}}',
    "en/sub/extra.bin": os.urandom(2_500),
    "en/empty.txt": b"",
}


class Head:
    """The head's store, served by the real StoreFiles; counts what it was asked; may corrupt one file's bytes."""

    def __init__(self, root, corrupt: str = "") -> None:
        self.files = StoreFiles(root)
        self.corrupt = corrupt
        self.asked: list[tuple[str, int, int]] = []

    async def __call__(self, req: StoreFetch | StoreList, timeout: float) -> StoreChunk | StoreListing:
        if isinstance(req, StoreList):
            self.asked.append(("list", 0, 0))
            return self.files.listing(req)
        self.asked.append((req.path, req.offset, req.length))
        out = self.files.read(req)
        if req.path == self.corrupt and out.data:
            out = msgspec.structs.replace(out, data=bytes([out.data[0] ^ 0xFF]) + out.data[1:])
        return out

    def fetched(self) -> list[str]:
        return sorted({p for p, _, n in self.asked if p != "list" and n})


@pytest.fixture
def store(tmp_path):
    root = tmp_path / "head" / "models"
    for rel, data in FILES.items():
        (root / "org" / "voices" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "org" / "voices" / rel).write_bytes(data)
    (root / "org" / "voices" / "en" / ".v.onnx.abc.incomplete").write_bytes(b"half a download")
    return root


def _same(local, files=FILES, base="en") -> bool:
    got = {
        p.relative_to(local).as_posix(): p.read_bytes()
        for p in local.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(local).parts)
    }
    return got == {k.removeprefix(base + "/"): v for k, v in files.items() if k.startswith(base + "/")}


async def test_a_folder_is_listed_then_fetched_file_by_file(store, tmp_path):
    head = Head(store)
    local = await fetch_folder(head, "org/voices/en/", tmp_path / "node", chunk=4000)
    assert local == tmp_path / "node" / "org" / "voices" / "en" and _same(local)
    assert head.asked[0] == ("list", 0, 0)
    assert head.fetched() == ["org/voices/en/sub/extra.bin", "org/voices/en/v.onnx", "org/voices/en/v.onnx.json"]
    assert ("org/voices/en/v.onnx", 8000, 4000) in head.asked  # in chunks
    assert not any(p.name.endswith(".partial") or p.name.endswith(".incomplete") for p in local.rglob("*"))
    head.asked.clear()
    assert await fetch_folder(head, "org/voices/en/", tmp_path / "node") == local
    assert head.asked == [("list", 0, 0)]  # every file here and verified: nothing fetched again


async def test_one_files_partial_resumes_and_the_rest_is_fetched(store, tmp_path):
    sha = hashlib.sha256(FILES["en/v.onnx"]).hexdigest()
    partial = tmp_path / "node" / "org" / "voices" / "en" / f".v.onnx.{sha[:16]}.partial"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(FILES["en/v.onnx"][:5000])
    head = Head(store)
    local = await fetch_folder(head, "org/voices/en/", tmp_path / "node", chunk=3000)
    assert _same(local) and not partial.exists()
    assert [(o, n) for p, o, n in head.asked if p == "org/voices/en/v.onnx"] == [(5000, 3000), (8000, 3000)]


async def test_a_corrupted_file_fails_the_folder_and_only_it_is_fetched_again(store, tmp_path):
    cfg = ModelConfig(name="v", engine="tts", path="/nowhere/en", store_path="org/voices/en/")
    with pytest.raises(FetchError, match="checksum mismatch fetching org/voices/en/v.onnx"):
        await ensure_local(cfg, Head(store, corrupt="org/voices/en/v.onnx"), tmp_path / "node")
    local = tmp_path / "node" / "org" / "voices" / "en"
    assert not (local / "v.onnx").exists()

    async def away(req, timeout):
        raise BusError("no_engine", "nobody serves coderai.cmd.store.list", retryable=True)

    with pytest.raises(FetchError, match="cannot fetch org/voices/en/"):  # half a folder is never used
        await ensure_local(cfg, away, tmp_path / "node")
    head = Head(store)
    got = await ensure_local(cfg, head, tmp_path / "node")
    assert got.path == str(local) and _same(local)
    assert head.fetched() == ["org/voices/en/v.onnx", "org/voices/en/v.onnx.json"]  # sub/extra.bin, verified, stayed
    assert (await ensure_local(cfg, away, tmp_path / "node")).path == str(local)  # whole now: used with the head away
    (local / "v.onnx.json").write_bytes(b"tampered after the fetch")
    with pytest.raises(FetchError, match="cannot fetch"):
        await ensure_local(cfg, away, tmp_path / "node")


async def test_a_listing_that_leaves_the_folder_is_refused(tmp_path):
    for bad in ("../../../escape", "/etc/passwd", ".hidden", "a/../../b", "a\\b"):

        async def evil(req, timeout, bad=bad):
            if isinstance(req, StoreList):
                return StoreListing(
                    files=[
                        StoreEntry(path="ok.bin", size=1, sha256="0" * 64),
                        StoreEntry(path=bad, size=1, sha256="0" * 64),
                    ]
                )
            raise AssertionError(f"fetched {req.path} after a bad listing")

        with pytest.raises(FetchError, match="leaves the folder"):
            await fetch_folder(evil, "org/repo/", tmp_path / "node")
    assert not (tmp_path / "node").exists() and not (tmp_path / "escape").exists()
    for bad in ("../x/", "/abs/", "/", "a//", ".hidden/"):
        with pytest.raises(FetchError):
            await fetch_folder(evil, bad, tmp_path / "node")


async def test_ensure_local_for_a_folder_and_a_file_inside_one(store, tmp_path):
    head = Head(store)
    whole = ModelConfig(name="w", engine="whisper", path="/nowhere/en", store_path="org/voices/en/")
    got = await ensure_local(whole, head, tmp_path / "node")
    assert got.path == str(tmp_path / "node" / "org" / "voices" / "en") and got.store_path == whole.store_path
    piper = ModelConfig(
        name="p", engine="tts", path="/nowhere/en/v.onnx", store_path="org/voices/en/", store_file="v.onnx"
    )
    got = await ensure_local(piper, head, tmp_path / "node2")
    assert got.path == str(tmp_path / "node2" / "org" / "voices" / "en" / "v.onnx")
    assert (tmp_path / "node2" / "org" / "voices" / "en" / "v.onnx.json").read_bytes() == FILES["en/v.onnx.json"]
    here = tmp_path / "here"
    here.mkdir()
    head.asked.clear()
    present = msgspec.structs.replace(piper, path=str(here))
    assert await ensure_local(present, head, tmp_path / "node3") is present
    assert head.asked == []  # the path exists on this node: nothing asked
    for cfg, why in (
        (msgspec.structs.replace(piper, store_file="nope.onnx"), "holds no 'nope.onnx'"),
        (msgspec.structs.replace(piper, store_file="../v.onnx"), "store_file"),
        (msgspec.structs.replace(piper, store_path="org/voices/en/v.onnx"), "needs a folder"),
        (msgspec.structs.replace(piper, store_path="org/nothing/"), "not_found"),
        (msgspec.structs.replace(piper, store_path="org/voices/en/v.onnx/"), "not a folder"),
    ):
        with pytest.raises(FetchError, match=why):
            await ensure_local(cfg, Head(store), tmp_path / "node4")


async def test_changes_on_the_head_since_an_earlier_fetch(store, tmp_path):
    node = tmp_path / "node"
    local = await fetch_folder(Head(store), "org/voices/en/", node)
    (local / "mine.txt").write_text("put here by hand")
    head_dir = store / "org" / "voices" / "en"
    (head_dir / "sub" / "extra.bin").unlink()
    (head_dir / "v.onnx.json").write_bytes(b'{"changed": true}')
    head = Head(store)
    await fetch_folder(head, "org/voices/en/", node)
    assert head.fetched() == ["org/voices/en/v.onnx.json"]
    assert (local / "v.onnx.json").read_bytes() == b'{"changed": true}'
    assert not (local / "sub" / "extra.bin").exists()  # fetched before, gone on the head: removed here
    assert (local / "mine.txt").exists()  # never fetched: left alone
