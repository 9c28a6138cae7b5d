"""Fetching a model file this node lacks from the head's model store, chunk by chunk over the bus
(`coderai.cmd.store.fetch`, served by the scheduler), so a model is pulled from the internet once.

The file grows in `.<name>.<sha16>.partial` beside its target and resumes from that file's size; the partial is
named by the head's sha256, so a file that changed on the head never resumes an old one. A finished file is hashed
and must match the head's sha256 before it is renamed into place.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from coderai.contracts import (
    BusError,
    ModelConfig,
    StoreChunk,
    StoreFetch,
    check_store_path,
)
from coderai.contracts.store import CHUNK_BYTES
from coderai.runtime.files import sha256_file
from coderai.contracts.subjects import CMD_STORE_FETCH
from coderai.engine_worker.engines import EngineLoadError

log = logging.getLogger("coderai.engine_worker")

Request = Callable[[StoreFetch, float], Awaitable[StoreChunk]]

FIRST_TIMEOUT_S = 600.0  # the head hashes a file on its first request: minutes for a big model
CHUNK_TIMEOUT_S = 60.0
PROGRESS_EVERY_S = 5.0


class FetchError(EngineLoadError):
    """The file could not be fetched from the head (unreachable, missing there, or corrupted on the way)."""


def bus_request(bus) -> Request:
    """A `Request` over `bus`."""

    async def _request(req: StoreFetch, timeout: float) -> StoreChunk:
        return await bus.request(CMD_STORE_FETCH, req, timeout=timeout)

    return _request


def local_path(models_dir: Path, store_path: str) -> Path:
    """Where a fetched file lives on this node: `<models_dir>/<store_path>` (a path that would leave it: FetchError)."""
    try:
        check_store_path(store_path)
    except ValueError as exc:
        raise FetchError(str(exc)) from None
    return models_dir / store_path


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


async def fetch_file(request: Request, store_path: str, models_dir: Path, *, chunk: int = CHUNK_BYTES) -> Path:
    """Make `<models_dir>/<store_path>` a copy of the head's file and return its path."""
    dest = local_path(models_dir, store_path)
    try:
        head = await request(StoreFetch(path=store_path, length=0), FIRST_TIMEOUT_S)
    except BusError as exc:
        if dest.is_file():  # fetched before; the head is away now
            log.warning("cannot reach the head's store for %s (%s); using the copy fetched before", store_path, exc.message)
            return dest
        raise FetchError(f"cannot fetch {store_path} from the head's model store: {exc}") from None
    if dest.is_file() and dest.stat().st_size == head.size and await asyncio.to_thread(_verified, dest, head.sha256):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.{head.sha256[:16]}.partial")
    done = partial.stat().st_size if partial.exists() else 0
    if done > head.size:
        partial.unlink()
        done = 0
    if done:
        log.info("resuming fetch of %s at %d of %d bytes", store_path, done, head.size)
    else:
        log.info("fetching %s (%d bytes) from the head's model store", store_path, head.size)
    t0 = last = time.monotonic()
    start = done
    with open(partial, "ab") as fh:  # noqa: ASYNC230 - 512 KB appends: cheaper inline than a thread each
        while done < head.size:
            try:
                part = await request(StoreFetch(path=store_path, offset=done, length=chunk), CHUNK_TIMEOUT_S)
            except BusError as exc:
                raise FetchError(f"fetching {store_path} stopped at {done} of {head.size} bytes: {exc}") from None
            if (part.size, part.sha256) != (head.size, head.sha256):
                fh.close()
                partial.unlink(missing_ok=True)
                raise FetchError(f"{store_path} changed on the head during the fetch; try again")
            if not part.data:
                raise FetchError(f"the head sent no bytes of {store_path} at offset {done} of {head.size}")
            fh.write(part.data)
            done += len(part.data)
            now = time.monotonic()
            if now - last >= PROGRESS_EVERY_S:
                last = now
                rate = (done - start) / max(now - t0, 1e-6)
                log.info("fetching %s: %d of %d bytes (%.0f%%, %.1f MB/s)", store_path, done, head.size,
                         100 * done / max(head.size, 1), rate / 1e6)
    got = await asyncio.to_thread(sha256_file, partial)
    if got != head.sha256:
        partial.unlink(missing_ok=True)
        raise FetchError(f"checksum mismatch fetching {store_path}: sha256 {got}, the head has {head.sha256}")
    os.replace(partial, dest)
    _sidecar(dest).write_text(got)
    log.info("fetched %s (%d bytes) in %.1fs", store_path, head.size, time.monotonic() - t0)
    return dest


async def ensure_local(config: ModelConfig, request: Request, models_dir: Path) -> ModelConfig:
    """`config` as this node should load it: unchanged when its `path` exists here (or it names no store file),
    else pointing at the copy fetched from the head's store."""
    if not config.store_path or os.path.exists(os.path.expanduser(config.path)):
        return config
    try:
        path = await fetch_file(request, config.store_path, models_dir)
    except OSError as exc:
        raise FetchError(f"cannot write {config.store_path} under {models_dir}: {exc}") from None
    return msgspec.structs.replace(config, path=str(path))
