"""The head's model store as nodes read it: paths that leave the store are refused, files come by range with the
whole file's size and sha256, and the hash is computed once per version of a file."""

from __future__ import annotations

import hashlib
import os

import pytest
from coderai.contracts import BusError, StoreChunk, StoreFetch, decode, encode
from coderai.contracts.store import CHUNK_BYTES
from coderai.contracts.subjects import CMD_STORE_FETCH
from coderai.scheduler.store import StoreFiles, resolve_store_path


@pytest.fixture
def store(tmp_path):
    root = tmp_path / "data" / "models"
    (root / "org" / "repo").mkdir(parents=True)
    (root / "org" / "repo" / "m.gguf").write_bytes(b"0123456789" * 100)
    (tmp_path / "secret").write_text("not yours")
    return root


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "/etc/passwd",
        "../secret",
        "org/../../secret",
        "org/repo/../../../secret",
        "./org/repo/m.gguf",
        "org//repo/m.gguf",
        ".jobs/x.json",
        "org/repo/.m.gguf.abc.incomplete",
        "org\\repo\\m.gguf",
    ],
)
def test_paths_that_leave_the_store_or_hide_are_refused(store, bad):
    with pytest.raises(BusError) as exc:
        resolve_store_path(store, bad)
    assert exc.value.code == "bad_request"


def test_a_symlink_out_of_the_store_is_refused(store, tmp_path):
    os.symlink(tmp_path / "secret", store / "org" / "link")
    os.symlink(tmp_path, store / "org" / "up")
    for rel in ("org/link", "org/up/secret"):
        with pytest.raises(BusError) as exc:
            resolve_store_path(store, rel)
        assert exc.value.code == "bad_request"


def test_missing_files_and_folders(store):
    with pytest.raises(BusError) as exc:
        resolve_store_path(store, "org/repo/nope.gguf")
    assert exc.value.code == "not_found"
    with pytest.raises(BusError) as exc:
        resolve_store_path(store, "org/repo")
    assert exc.value.code == "bad_request"
    assert resolve_store_path(store, "org/repo/m.gguf") == (store / "org" / "repo" / "m.gguf").resolve()


def test_ranges_carry_the_whole_files_size_and_sha(store):
    files = StoreFiles(store)
    whole = (store / "org" / "repo" / "m.gguf").read_bytes()
    sha = hashlib.sha256(whole).hexdigest()
    head = files.read(StoreFetch(path="org/repo/m.gguf", length=0))
    assert (head.data, head.size, head.sha256) == (b"", 1000, sha)
    got = b""
    while len(got) < head.size:
        part = files.read(StoreFetch(path="org/repo/m.gguf", offset=len(got), length=300))
        assert part.sha256 == sha and len(part.data) <= 300
        got += part.data
    assert got == whole
    assert files.read(StoreFetch(path="org/repo/m.gguf", offset=5000)).data == b""
    with pytest.raises(BusError):
        files.read(StoreFetch(path="org/repo/m.gguf", offset=-1))


def test_the_hash_is_kept_per_version_of_a_file(store, monkeypatch):
    import coderai.scheduler.store as mod

    files = StoreFiles(store)
    calls = []
    real = mod.sha256_file
    monkeypatch.setattr(mod, "sha256_file", lambda p: calls.append(p) or real(p))
    for _ in range(3):
        files.read(StoreFetch(path="org/repo/m.gguf", length=10))
    assert len(calls) == 1
    (store / "org" / "repo" / "m.gguf").write_bytes(b"changed")
    assert files.read(StoreFetch(path="org/repo/m.gguf")).sha256 == hashlib.sha256(b"changed").hexdigest()
    assert len(calls) == 2


def test_a_full_chunk_fits_a_nats_message():
    msg = StoreChunk(data=os.urandom(CHUNK_BYTES), size=1 << 40, sha256="f" * 64)
    wire = encode(msg)
    assert len(wire) < 1 << 20  # NATS' default max payload
    assert CMD_STORE_FETCH.decode_reply(wire) == msg
    req = StoreFetch(path="a/b.gguf", offset=3, length=7)
    assert decode(encode(req), StoreFetch) == req
