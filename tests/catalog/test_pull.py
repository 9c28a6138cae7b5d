"""pull() against the fake Hub: progress, resume, checksums, errors, whole-repo pulls."""

from __future__ import annotations

import hashlib
import threading

import pytest
from coderai.catalog import Cancelled, ChecksumError, ModelStore, NotFound, pull

REPO = "acme/tiny-GGUF"
FILE = "tiny-q4_k_m.gguf"


def test_pull_reports_progress_to_100(fake_hub, hf_env, tmp_path, blob):
    data = blob(600_000)
    fake_hub.add(REPO, {FILE: data, "README.md": b"hi"})
    fake_hub.delay_s = 0.01
    seen = []
    store = ModelStore(tmp_path)
    rec = pull(f"{REPO}:{FILE}", store, seen.append)
    path = store.model_path(rec)
    assert path == tmp_path.resolve() / "models" / REPO / FILE
    assert path.read_bytes() == data
    assert rec.engine == "llama-server" and rec.kind == "chat" and rec.name == "tiny-q4_k_m"
    downloading = [p for p in seen if p.state == "downloading"]
    done = [p.bytes_done for p in downloading]
    assert len(set(done)) >= 3 and done == sorted(done)
    assert any(0 < p.percent < 100 for p in downloading)
    assert seen[-1].state == "done" and seen[-1].percent == 100.0 and seen[-1].bytes_total == len(data)
    assert any(p.rate_bps > 0 for p in seen)
    assert [r.name for r in store.list()] == ["tiny-q4_k_m"]
    assert not list(path.parent.glob("*.incomplete"))


def test_dropped_connection_resumes_with_a_range_request(fake_hub, hf_env, tmp_path, blob):
    data = blob(300_000, seed=2)
    fake_hub.add(REPO, {FILE: data})
    fake_hub.drop_at[FILE] = 100_000
    rec = pull(f"{REPO}:{FILE}", ModelStore(tmp_path))
    first, resumed = fake_hub.ranges(FILE)  # the client resumes from the whole chunks it wrote
    assert first == "" and 0 < int(resumed.removeprefix("bytes=").rstrip("-")) <= 100_000
    got = ModelStore(tmp_path).model_path(rec).read_bytes()
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(data).hexdigest()


def test_cancelled_pull_resumes_where_it_stopped(fake_hub, hf_env, tmp_path, blob):
    data = blob(400_000, seed=3)
    fake_hub.add(REPO, {FILE: data})
    fake_hub.delay_s = 0.02
    stop = threading.Event()

    def cb(p):
        if p.bytes_done >= 150_000:
            stop.set()

    store = ModelStore(tmp_path)
    with pytest.raises(Cancelled):
        pull(f"{REPO}:{FILE}", store, cb, cancel=stop)
    partial = list((store.root / "acme" / "tiny-GGUF").glob(".*.incomplete"))
    assert len(partial) == 1 and 150_000 <= partial[0].stat().st_size < len(data)
    kept = partial[0].stat().st_size
    seen = []
    rec = pull(f"{REPO}:{FILE}", store, seen.append)
    assert fake_hub.ranges(FILE)[-1] == f"bytes={kept}-"
    assert store.model_path(rec).read_bytes() == data
    assert seen[0].bytes_done == 0 and any(p.bytes_done == kept for p in seen)


def test_corrupted_download_is_rejected_and_deleted(fake_hub, hf_env, tmp_path, blob):
    fake_hub.add(REPO, {FILE: blob(50_000, seed=4)})
    fake_hub.corrupt.add(FILE)
    store = ModelStore(tmp_path)
    with pytest.raises(ChecksumError, match="checksum mismatch") as err:
        pull(f"{REPO}:{FILE}", store)
    assert err.value.want == fake_hub.etag(REPO, FILE)
    folder = store.root / REPO
    assert not (folder / FILE).exists() and not list(folder.glob(".*.incomplete"))
    assert store.list() == []


def test_unknown_repo_and_file_are_clear_errors(fake_hub, hf_env, tmp_path):
    store = ModelStore(tmp_path)
    with pytest.raises(NotFound, match="no repo 'nobody/nothing'"):
        pull("nobody/nothing:x.gguf", store)
    with pytest.raises(NotFound, match="no repo 'nobody/nothing'"):
        pull("nobody/nothing", store)
    fake_hub.add(REPO, {FILE: b"x"})
    with pytest.raises(NotFound, match="no such file"):
        pull(f"{REPO}:missing.gguf", store)
    with pytest.raises(Exception, match="neither a catalogue name"):
        pull("not-a-model", store)


def test_whole_repo_pull_checks_plain_files_by_git_sha1_and_guesses_the_engine(fake_hub, hf_env, tmp_path, blob):
    files = {
        "model.bin": blob(70_000, 5),
        "tokenizer.json": b'{"a": 1}',
        "config.json": b"{}",
        "vocabulary.txt": b"a\nb\n",
        "README.md": b"# whisper",
    }
    fake_hub.add("acme/faster-whisper-nano", files, plain=("tokenizer.json", "config.json", "vocabulary.txt"))
    store = ModelStore(tmp_path)
    rec = pull("acme/faster-whisper-nano", store)
    assert rec.engine == "whisper" and rec.main == "" and sorted(rec.files) == sorted(set(files) - {"README.md"})
    assert store.model_path(rec) == store.root / "acme" / "faster-whisper-nano"
    assert (store.model_path(rec) / "tokenizer.json").read_bytes() == b'{"a": 1}'
    again = []
    pull("acme/faster-whisper-nano", store, again.append)  # already there: nothing is fetched
    assert [m for m, *_ in fake_hub.requests].count("GET") == 1 + 4 + 1  # info, 4 files, info again


def test_a_repo_of_many_ggufs_asks_for_one(fake_hub, hf_env, tmp_path):
    fake_hub.add("acme/multi-GGUF", {"a-q4.gguf": b"1", "a-q8.gguf": b"2"})
    with pytest.raises(Exception, match="pick one as acme/multi-GGUF:<file>"):
        pull("acme/multi-GGUF", ModelStore(tmp_path))
