"""The head lists a folder of its model store for a node (a model of several files): regular files at any depth with
size and sha256; no hidden files, nothing whose real path leaves the store, and the same refusals as a file fetch."""

from __future__ import annotations

import hashlib
import os

import pytest
from coderai.contracts import (
    BusError,
    StoreEntry,
    StoreList,
    StoreListing,
    decode,
    encode,
)
from coderai.contracts.store import MAX_LIST_BYTES, MAX_LIST_FILES
from coderai.contracts.subjects import CMD_STORE_LIST
from coderai.scheduler.store import StoreFiles


@pytest.fixture
def store(tmp_path):
    root = tmp_path / "data" / "models"
    repo = root / "org" / "repo"
    (repo / "unet").mkdir(parents=True)
    (repo / "model_index.json").write_text("{}")
    (repo / "unet" / "weights.bin").write_bytes(b"w" * 3000)
    (repo / ".weights.bin.abc.incomplete").write_bytes(b"half")  # a pull in progress
    (repo / ".cache").mkdir()
    (repo / ".cache" / "x").write_text("hidden folder")
    (root / "org" / "other.gguf").write_bytes(b"g" * 10)
    (tmp_path / "secret").write_text("not yours")
    os.symlink(tmp_path / "secret", repo / "leak")  # a file outside the store
    os.symlink(tmp_path, repo / "up")  # a folder outside the store
    os.symlink(root / "org" / "other.gguf", repo / "alias.gguf")  # a file inside it: served as that file
    os.symlink(repo / "unet", repo / "unet-again")  # a linked folder: not entered
    return root


def test_a_folder_lists_its_files_with_size_and_sha(store):
    got = StoreFiles(store).listing(StoreList(path="org/repo"))
    sha = lambda b: hashlib.sha256(b).hexdigest()
    assert got == StoreListing(
        files=[
            StoreEntry(path="alias.gguf", size=10, sha256=sha(b"g" * 10)),
            StoreEntry(path="model_index.json", size=2, sha256=sha(b"{}")),
            StoreEntry(path="unet/weights.bin", size=3000, sha256=sha(b"w" * 3000)),
        ]
    )
    assert StoreFiles(store).listing(StoreList(path="org/repo/unet")).files[0].path == "weights.bin"


@pytest.mark.parametrize(
    "bad", ["", "/etc", "../", "org/../..", "org/repo/../../..", "./org", ".cache", "org/repo/.cache", "org\\repo"]
)
def test_paths_that_leave_the_store_or_hide_are_refused(store, bad):
    with pytest.raises(BusError) as exc:
        StoreFiles(store).listing(StoreList(path=bad))
    assert exc.value.code == "bad_request"


def test_files_missing_folders_and_links_out(store):
    files = StoreFiles(store)
    for rel, code in (
        ("org/repo/model_index.json", "bad_request"),
        ("org/nope", "not_found"),
        ("org/repo/up", "bad_request"),
    ):
        with pytest.raises(BusError) as exc:
            files.listing(StoreList(path=rel))
        assert exc.value.code == code, rel


def test_a_folder_too_big_to_list_is_refused(store, monkeypatch):
    import coderai.scheduler.store as mod

    monkeypatch.setattr(mod, "MAX_LIST_FILES", 2)
    with pytest.raises(BusError, match="holds 3 files"):
        StoreFiles(store).listing(StoreList(path="org/repo"))
    monkeypatch.setattr(mod, "MAX_LIST_FILES", 3)
    monkeypatch.setattr(mod, "MAX_LIST_BYTES", 200)
    with pytest.raises(BusError, match="too big for one message"):
        StoreFiles(store).listing(StoreList(path="org/repo"))


def test_a_full_listing_fits_a_nats_message():
    entry = StoreEntry(path="x" * 100 + "/model-00001-of-00099.safetensors", size=1 << 40, sha256="f" * 64)
    wire = encode(StoreListing(files=[entry] * MAX_LIST_FILES))
    assert len(wire) < 1 << 20 and MAX_LIST_BYTES < 1 << 20  # NATS' default max payload
    assert CMD_STORE_LIST.decode_reply(encode(StoreListing(files=[entry]))) == StoreListing(files=[entry])
    assert decode(encode(StoreList(path="a/b")), StoreList) == StoreList(path="a/b")
