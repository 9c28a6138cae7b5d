"""`pull`: download a model from the Hugging Face Hub (or an `HF_ENDPOINT` mirror) into the model store.

huggingface_hub does the talking: `model_info` lists a repo's files, `get_hf_file_metadata` (a HEAD on
`/<repo>/resolve/<rev>/<file>`) gives each file's etag (the sha256 for LFS files, X-Linked-Etag), size and
download location, and `http_get` streams it with Range resumes and retries on dropped connections. The partial
file is ours (`.<file>.<etag>.incomplete` beside the target, not huggingface_hub's per-process temp file), so a
pull that was killed or cancelled resumes from where it stopped. Every file is hashed before it is moved in place:
sha256 against an LFS etag, the git blob sha1 against a plain one; a mismatch deletes the file and fails.
"""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from coderai.catalog.entries import Entry, guess_engine, resolve, select
from coderai.runtime.files import git_blob_sha1, sha256_file
from coderai.catalog.errors import (
    Cancelled,
    CatalogError,
    ChecksumError,
    MissingExtra,
    NotFound,
    Unreachable,
)
from coderai.catalog.store import FileRecord, ModelStore, Pulled

SHA256 = re.compile(r"^[0-9a-f]{64}$")
SHA1 = re.compile(r"^[0-9a-f]{40}$")


class Progress(msgspec.Struct, kw_only=True):
    """What a pull reports, many times a second at most. `state`: resolving, downloading, verifying, done, failed."""

    name: str
    state: str = "resolving"
    file: str = ""
    bytes_done: int = 0
    bytes_total: int = 0
    percent: float = 0.0
    rate_bps: float = 0.0
    files_done: int = 0
    files_total: int = 0
    error: str = ""


ProgressCb = Callable[[Progress], None]


def hub():
    """huggingface_hub, imported on first use (it is the optional `catalog` extra)."""
    try:
        import huggingface_hub
    except ImportError:
        raise MissingExtra("pulling models needs huggingface_hub: pip install 'coderai[catalog]'") from None
    return huggingface_hub


class _Tracker:
    """Adds bytes up across files, computes percent and rate, throttles callbacks, and honours a cancel flag."""

    def __init__(self, p: Progress, cb: ProgressCb | None, cancel: threading.Event | None) -> None:
        self.p, self.cb, self.cancel = p, cb, cancel
        self.last = self.last_pct = 0.0
        self.window = (time.monotonic(), 0)

    def emit(self, force: bool = False, **changes: Any) -> None:
        for k, v in changes.items():
            setattr(self.p, k, v)
        now = time.monotonic()
        t0, d0 = self.window
        if now - t0 >= 0.25:
            self.p.rate_bps = round((self.p.bytes_done - d0) / (now - t0), 1)
            self.window = (now, self.p.bytes_done)
        total = self.p.bytes_total
        self.p.percent = round(100.0 * self.p.bytes_done / total, 2) if total else 0.0
        if self.cb and (force or now - self.last >= 0.1 or self.p.percent - self.last_pct >= 5):
            self.last, self.last_pct = now, self.p.percent
            self.cb(msgspec.structs.replace(self.p))

    def advance(self, n: int) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled(f"pull of {self.p.name} cancelled; pull again to resume")
        self.p.bytes_done += n
        self.emit()

    def skip(self, n: int) -> None:
        """Bytes already on disk: counted as done, not as transfer rate."""
        self.p.bytes_done += n
        self.window = (time.monotonic(), self.p.bytes_done)
        self.emit(force=True)

    def bar(self, **_kw: Any) -> _Bar:
        return _Bar(self)


class _Bar:
    """The `tqdm_class` huggingface_hub's `http_get` is given: only `update` matters."""

    def __init__(self, tracker: _Tracker) -> None:
        self.t = tracker

    def update(self, n: int = 1) -> None:
        self.t.advance(n)

    def close(self) -> None:
        pass

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def pull(
    spec: str | Entry,
    store: ModelStore,
    progress_cb: ProgressCb | None = None,
    *,
    name: str = "",
    endpoint: str | None = None,
    token: str | None = None,
    cancel: threading.Event | None = None,
) -> Pulled:
    """Download `spec` (a catalogue name, `<repo>` or `<repo>:<file>`, or an Entry: a model's `source`) into
    `store` and record it; returns the record. Raises NotFound (unknown repo, revision or file), ChecksumError,
    Cancelled, MissingExtra, Unreachable, or CatalogError (other network and Hub errors). `endpoint` defaults to
    `HF_ENDPOINT`, `token` to `HF_TOKEN`."""
    entry = spec if isinstance(spec, Entry) else resolve(spec, name)
    tracker = _Tracker(Progress(name=entry.name), progress_cb, cancel)
    try:
        rec = _pull(
            entry,
            store,
            tracker,
            endpoint or os.environ.get("HF_ENDPOINT") or None,
            token or os.environ.get("HF_TOKEN") or None,
        )
    except CatalogError as exc:
        tracker.emit(force=True, state="failed", error=str(exc))
        raise
    tracker.emit(force=True, state="done", file="", files_done=len(rec.files))
    return rec


def plan(entry: Entry, endpoint: str | None, token: str | None) -> dict[str, tuple[str, Any]]:
    """The files a pull of `entry` takes, each with its URL and the Hub's metadata for it (a HEAD: `size`, `etag`
    (the sha256 of an LFS file), `commit_hash`, `location`); nothing is downloaded. Raises as `pull` does."""
    hf = hub()
    with _hub_errors(entry, endpoint):
        files = list(entry.files)
        if not files:
            info = hf.HfApi(endpoint=endpoint, token=token).model_info(
                entry.repo, revision=entry.revision, files_metadata=True
            )
            files = select(entry, [s.rfilename for s in info.siblings or []])
            if not files:
                raise NotFound(f"{entry.repo} has no files to pull (after include/exclude)")
        metas = {}
        for f in files:
            url = hf.hf_hub_url(entry.repo, f, revision=entry.revision, endpoint=endpoint)
            metas[f] = (url, hf.get_hf_file_metadata(url, token=token))
    return metas


def _pull(entry: Entry, store: ModelStore, t: _Tracker, endpoint: str | None, token: str | None) -> Pulled:
    metas = plan(entry, endpoint, token)
    files = list(metas)
    t.emit(
        force=True, state="downloading", files_total=len(files), bytes_total=sum(m.size or 0 for _, m in metas.values())
    )
    known = {(r.repo, f): fr.etag for r in store.list() for f, fr in r.files.items()}
    records: dict[str, FileRecord] = {}
    for i, (f, (url, meta)) in enumerate(metas.items()):
        etag = (meta.etag or "").lower()
        t.emit(force=True, state="downloading", file=f, files_done=i)
        with _hub_errors(entry, endpoint):
            size = _fetch(store, entry.repo, f, url, meta, etag, known.get((entry.repo, f)) == etag, t, token)
        records[f] = FileRecord(size=size, etag=etag)
    engine, kind, main = entry.engine, entry.kind, entry.main
    if not engine:
        engine, kind, guessed_main = guess_engine(files)
        main = main or guessed_main
        if not engine:
            raise CatalogError(
                f"pulled {entry.repo}, but cannot tell which engine serves it; add it to the models file by hand"
            )
    commit = next((m.commit_hash for _, m in metas.values() if m.commit_hash), "") or ""
    return store.add(
        Pulled(
            name=entry.name,
            repo=entry.repo,
            revision=entry.revision,
            commit=commit,
            files=records,
            main=main,
            engine=engine,
            kind=kind,
            params=dict(entry.params),
            memory_mb=entry.memory_mb,
        )
    )


def _fetch(
    store: ModelStore, repo: str, f: str, url: str, meta: Any, etag: str, recorded: bool, t: _Tracker, token: str | None
) -> int:
    """One file into place (skipped when it is already there and verified); returns its size."""
    dest = store.file_path(repo, f)
    in_place = dest.is_file() and (meta.size is None or dest.stat().st_size == meta.size)
    if in_place and (recorded or (SHA256.match(etag) and sha256_file(dest) == etag)):
        t.skip(dest.stat().st_size)
        return dest.stat().st_size
    part = store.partial_path(repo, f, etag)
    part.parent.mkdir(parents=True, exist_ok=True)
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers(token=token)
    headers["Accept-Encoding"] = "identity"  # byte offsets must be the file's
    location = meta.location or url
    if urlsplit(location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)  # a CDN's signed URL must not see the token
    with open(part, "ab") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CatalogError(f"{repo}/{f} is being pulled by another process") from None
        resume = fh.seek(0, os.SEEK_END)
        if meta.size is not None and resume > meta.size:  # not a prefix of this file: start over
            fh.truncate(0)
            fh.seek(0)
            resume = 0
        t.skip(resume)
        kw: dict[str, Any] = {"resume_size": resume, "headers": headers, "expected_size": meta.size}
        if "tqdm_class" in inspect.signature(http_get).parameters:
            kw["tqdm_class"] = t.bar
            http_get(location, fh, **kw)
        else:  # an older huggingface_hub: watch the file grow instead
            with _poll_size(part, t, resume):
                http_get(location, fh, **kw)
    t.emit(force=True, state="verifying")
    _verify(part, f, etag)
    os.replace(part, dest)
    return dest.stat().st_size


@contextlib.contextmanager
def _poll_size(part: Path, t: _Tracker, start: int):
    stop = threading.Event()

    def watch() -> None:
        seen = start
        while not stop.wait(0.25):
            with contextlib.suppress(OSError):
                size = part.stat().st_size
                t.advance(size - seen)
                seen = size

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()


def _verify(part: Path, f: str, etag: str) -> None:
    """sha256 for an LFS etag, git blob sha1 for a plain one; any other etag (a mirror's) is not a hash."""
    got = sha256_file(part) if SHA256.match(etag) else git_blob_sha1(part) if SHA1.match(etag) else ""
    if got and got != etag:
        part.unlink(missing_ok=True)
        raise ChecksumError(f, etag, got)


@contextlib.contextmanager
def _hub_errors(entry: Entry, endpoint: str | None):
    """huggingface_hub's and the transport's errors, as ours with a sentence an operator can act on."""
    from huggingface_hub import utils as u

    where = endpoint or "huggingface.co"
    try:
        yield
    except u.GatedRepoError:
        raise CatalogError(f"{entry.repo} is gated: accept its licence on the Hub and set HF_TOKEN") from None
    except u.RepositoryNotFoundError:
        raise NotFound(f"no repo {entry.repo!r} on {where} (or it is private: set HF_TOKEN)") from None
    except u.RevisionNotFoundError:
        raise NotFound(f"{entry.repo} has no revision {entry.revision!r}") from None
    except u.EntryNotFoundError as exc:
        raise NotFound(f"{entry.repo}@{entry.revision}: no such file ({_first_line(exc)})") from None
    except u.HfHubHTTPError as exc:
        raise CatalogError(f"the Hub refused {entry.repo}: {_first_line(exc)}") from None
    except CatalogError:
        raise
    except Exception as exc:
        if _unreachable(exc):
            raise Unreachable(f"{where} unreachable (offline?): {type(exc).__name__}: {_first_line(exc)}") from None
        if isinstance(exc, OSError) or type(exc).__module__.split(".")[0].startswith("httpx"):
            raise CatalogError(f"download of {entry.repo} failed: {type(exc).__name__}: {exc}") from None
        raise


def _unreachable(exc: BaseException) -> bool:
    """Whether `exc` says the Hub could not be reached at all (refused, no route, DNS, a connect timeout), as
    opposed to an answer that was an error: the one a check may skip, saying so."""
    if isinstance(exc, ConnectionError):
        return True
    name = type(exc).__name__
    return name in ("ConnectError", "ConnectTimeout") or (
        name == "ConnectionError" and "requests" in type(exc).__module__
    )


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
