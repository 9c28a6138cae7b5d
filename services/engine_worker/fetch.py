"""Fetching a model file this node lacks from the head's model store, chunk by chunk over the bus
(`coderai.cmd.store.fetch`, served by the scheduler), so a model is pulled from the internet once.

The file grows in `.<name>.<sha16>.partial` beside its target and resumes from that file's size; the partial is
named by the head's sha256, so a file that changed on the head never resumes an old one. A finished file is hashed
and must match the head's sha256 before it is renamed into place.

A model that is a folder (`store_path` ending in "/") is listed first (`coderai.cmd.store.list`: every file's
relative path, size and sha256), then fetched file by file the same way. A manifest beside the folder
(`.<folder>.folder.json`) records the listing and says `complete` only once every file is verified; a folder is
used only then, so a half-fetched folder is never loaded. Files an earlier fetch brought that the head no longer
lists are removed; files this node did not fetch are left alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Protocol, overload

import msgspec
from coderai.contracts import (
    BusError,
    ModelConfig,
    StoreChunk,
    StoreEntry,
    StoreFetch,
    StoreList,
    StoreListing,
    check_store_path,
)
from coderai.contracts.store import CHUNK_BYTES
from coderai.contracts.subjects import CMD_STORE_FETCH, CMD_STORE_LIST
from coderai.engine_worker.engines import EngineLoadError
from coderai.runtime.bus import Bus
from coderai.runtime.files import sha256_file

log = logging.getLogger("coderai.engine_worker")


class Request(Protocol):
    """One callable for both questions, with a timeout in seconds: a StoreFetch gets a StoreChunk, a StoreList a
    StoreListing."""

    @overload
    def __call__(self, req: StoreFetch, timeout: float, /) -> Awaitable[StoreChunk]: ...
    @overload
    def __call__(self, req: StoreList, timeout: float, /) -> Awaitable[StoreListing]: ...


FIRST_TIMEOUT_S = 600.0  # the head hashes a file on its first request: minutes for a big model
CHUNK_TIMEOUT_S = 60.0
PROGRESS_EVERY_S = 5.0


class FetchError(EngineLoadError):
    """The file could not be fetched from the head (unreachable, missing there, or corrupted on the way)."""


def bus_request(bus: Bus) -> Request:
    """A `Request` over `bus`."""

    @overload
    async def _request(req: StoreFetch, timeout: float, /) -> StoreChunk: ...
    @overload
    async def _request(req: StoreList, timeout: float, /) -> StoreListing: ...
    async def _request(req: StoreFetch | StoreList, timeout: float, /) -> StoreChunk | StoreListing:
        subject = CMD_STORE_LIST if isinstance(req, StoreList) else CMD_STORE_FETCH
        return await bus.request(subject, req, timeout=timeout)

    return _request


def local_path(models_dir: Path, store_path: str) -> Path:
    """Where a fetched file lives on this node: `<models_dir>/<store_path>` (a path that would leave it: FetchError)."""
    try:
        check_store_path(store_path)
    except ValueError as exc:
        raise FetchError(str(exc)) from None
    return models_dir / store_path


MAX_STORED = 256  # store paths a heartbeat lists at most


def stored_files(models_dir: Path) -> list[str]:
    """The store paths this node holds, fetched and verified (each has its sha256 note), sorted; at most
    MAX_STORED. Placement prefers a node that has a model's files: it loads without fetching them."""
    out: list[str] = []
    if not models_dir.is_dir():
        return out
    for note in sorted(models_dir.rglob(".*.sha256")):
        target = note.with_name(note.name[1 : -len(".sha256")])
        if target.is_file():
            out.append(target.relative_to(models_dir).as_posix())
            if len(out) >= MAX_STORED:
                break
    return sorted(out)


def _sidecar(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.sha256")


def _verified(dest: Path, sha256: str) -> bool:
    """Whether `dest` is the file with this sha256: by the note left when it was fetched, else by hashing it."""
    note = _sidecar(dest)
    if note.exists() and note.stat().st_mtime_ns >= dest.stat().st_mtime_ns:
        return note.read_text().strip() == sha256
    got = sha256_file(dest)
    note.write_text(got)
    return got == sha256


def _have(dest: Path, size: int, sha256: str) -> bool:
    """Whether `dest` already is the head's file of this size and sha256 (blocking: it may hash)."""
    return dest.is_file() and dest.stat().st_size == size and _verified(dest, sha256)


async def fetch_file(request: Request, store_path: str, models_dir: Path, *, chunk: int = CHUNK_BYTES) -> Path:
    """Make `<models_dir>/<store_path>` a copy of the head's file and return its path."""
    dest = local_path(models_dir, store_path)
    try:
        head = await request(StoreFetch(path=store_path, length=0), FIRST_TIMEOUT_S)
    except BusError as exc:
        if dest.is_file():  # fetched before; the head is away now
            log.warning(
                "cannot reach the head's store for %s (%s); using the copy fetched before", store_path, exc.message
            )
            return dest
        raise FetchError(f"cannot fetch {store_path} from the head's model store: {exc}") from None
    if await asyncio.to_thread(_have, dest, head.size, head.sha256):
        return dest
    await _fetch_into(request, store_path, dest, head.size, head.sha256, chunk)
    return dest


async def _fetch_into(request: Request, store_path: str, dest: Path, size: int, sha256: str, chunk: int) -> None:
    """Fetch the head's `store_path` (`size` bytes, `sha256`) into `dest`: resume its partial, verify, rename."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.{sha256[:16]}.partial")
    done = partial.stat().st_size if partial.exists() else 0
    if done > size:
        partial.unlink()
        done = 0
    if done:
        log.info("resuming fetch of %s at %d of %d bytes", store_path, done, size)
    else:
        log.info("fetching %s (%d bytes) from the head's model store", store_path, size)
    t0 = last = time.monotonic()
    start = done
    with open(partial, "ab") as fh:  # 512 KB appends: cheaper inline than a thread each
        while done < size:
            try:
                part = await request(StoreFetch(path=store_path, offset=done, length=chunk), CHUNK_TIMEOUT_S)
            except BusError as exc:
                raise FetchError(f"fetching {store_path} stopped at {done} of {size} bytes: {exc}") from None
            if (part.size, part.sha256) != (size, sha256):
                fh.close()
                partial.unlink(missing_ok=True)
                raise FetchError(f"{store_path} changed on the head during the fetch; try again")
            if not part.data:
                raise FetchError(f"the head sent no bytes of {store_path} at offset {done} of {size}")
            fh.write(part.data)
            done += len(part.data)
            now = time.monotonic()
            if now - last >= PROGRESS_EVERY_S:
                last = now
                rate = (done - start) / max(now - t0, 1e-6)
                log.info(
                    "fetching %s: %d of %d bytes (%.0f%%, %.1f MB/s)",
                    store_path,
                    done,
                    size,
                    100 * done / max(size, 1),
                    rate / 1e6,
                )
    got = await asyncio.to_thread(sha256_file, partial)
    if got != sha256:
        partial.unlink(missing_ok=True)
        raise FetchError(f"checksum mismatch fetching {store_path}: sha256 {got}, the head has {sha256}")
    os.replace(partial, dest)
    _sidecar(dest).write_text(got)
    log.info("fetched %s (%d bytes) in %.1fs", store_path, size, time.monotonic() - t0)


class _Manifest(msgspec.Struct, kw_only=True):
    """What this node fetched of a store folder; `complete` only once every file was verified."""

    complete: bool = False
    files: list[StoreEntry] = []


def _manifest_path(local: Path) -> Path:
    return local.with_name(f".{local.name}.folder.json")


def _read_manifest(local: Path) -> _Manifest:
    try:
        return msgspec.json.decode(_manifest_path(local).read_bytes(), type=_Manifest)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return _Manifest()


def _write_manifest(local: Path, manifest: _Manifest) -> None:
    path = _manifest_path(local)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(msgspec.json.encode(manifest))
    os.replace(tmp, path)


def _complete(local: Path) -> bool:
    """Whether the folder was fetched whole before and every file is still the one verified then."""
    m = _read_manifest(local)
    return m.complete and bool(m.files) and all(_have(local / e.path, e.size, e.sha256) for e in m.files)


def folder_of(store_path: str) -> str:
    """The folder a folder `store_path` ("org/repo/") names, checked ("org/repo"); FetchError for a bad one."""
    folder = store_path.removesuffix("/")
    try:
        check_store_path(folder)
    except ValueError as exc:
        raise FetchError(str(exc)) from None
    return folder


async def fetch_folder(
    request: Request, store_path: str, models_dir: Path, *, holds: str = "", chunk: int = CHUNK_BYTES
) -> Path:
    """Make `<models_dir>/<folder>` hold a verified copy of every file of the head's store folder `store_path`
    ("org/repo/") and return the folder; `holds`: a file (relative to the folder) that must be among them."""
    folder = folder_of(store_path)
    local = models_dir / folder
    try:
        listing = await request(StoreList(path=folder), FIRST_TIMEOUT_S)
    except BusError as exc:
        if await asyncio.to_thread(_complete, local) and (not holds or (local / holds).is_file()):
            log.warning(
                "cannot reach the head's store for %s (%s); using the copy fetched before", store_path, exc.message
            )
            return local
        raise FetchError(f"cannot fetch {store_path} from the head's model store: {exc}") from None
    if not listing.files:
        raise FetchError(f"the head's store folder {store_path} holds no files")
    for e in listing.files:
        try:
            check_store_path(e.path)
        except ValueError:
            raise FetchError(f"the head listed {e.path!r} in {store_path}: a path that leaves the folder") from None
    names = {e.path for e in listing.files}
    if holds and holds not in names:
        raise FetchError(f"the head's store folder {store_path} holds no {holds!r}")
    for gone in {e.path for e in _read_manifest(local).files} - names:  # fetched before, no longer on the head
        (local / gone).unlink(missing_ok=True)
        _sidecar(local / gone).unlink(missing_ok=True)
    local.mkdir(parents=True, exist_ok=True)
    _write_manifest(local, _Manifest(complete=False, files=list(listing.files)))
    todo = [
        e
        for e in listing.files  # a file already here and verified is not fetched again
        if not await asyncio.to_thread(_have, local / e.path, e.size, e.sha256)
    ]
    if todo:
        log.info(
            "fetching %d of the %d files of %s (%d bytes) from the head's model store",
            len(todo),
            len(listing.files),
            store_path,
            sum(e.size for e in todo),
        )
    for e in todo:
        await _fetch_into(request, f"{folder}/{e.path}", local / e.path, e.size, e.sha256, chunk)
    _write_manifest(local, _Manifest(complete=True, files=list(listing.files)))
    return local


async def ensure_local(config: ModelConfig, request: Request, models_dir: Path) -> ModelConfig:
    """`config` as this node should load it: unchanged when its `path` exists here (or it names nothing in the
    store), else pointing at the copy fetched from the head's store: the file, the folder, or `store_file` in it."""
    if not config.store_path or os.path.exists(os.path.expanduser(config.path)):
        return config
    async with _fetching.setdefault(config.store_path, asyncio.Lock()):  # two engines of one model: one fetch
        return await _ensure_local(config, request, models_dir)


_fetching: dict[str, asyncio.Lock] = {}
"""One lock per store path: a second engine (another replica, a reload) waits for the first one's fetch and
then finds the copy verified, instead of appending to the same partial file."""


async def _ensure_local(config: ModelConfig, request: Request, models_dir: Path) -> ModelConfig:
    try:
        if config.store_path.endswith("/"):
            holds = config.store_file
            if holds:
                try:
                    check_store_path(holds)
                except ValueError as exc:
                    raise FetchError(f"store_file: {exc}") from None
            folder = await fetch_folder(request, config.store_path, models_dir, holds=holds)
            path = folder / holds if holds else folder
        elif config.store_file:
            raise FetchError(f"store_file needs a folder store_path (ending in '/'), not {config.store_path!r}")
        else:
            path = await fetch_file(request, config.store_path, models_dir)
    except OSError as exc:
        raise FetchError(f"cannot write {config.store_path} under {models_dir}: {exc}") from None
    return msgspec.structs.replace(config, path=str(path))
