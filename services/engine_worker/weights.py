"""A model's weights fetched by its `source` when this node lacks its `path`, as a rented pod always does: the
operator's folders are not there.

`hf://` sources and catalogue ids go through the catalogue's own pull (coderai.catalog.pull: resumable downloads,
`HF_TOKEN` from the environment, every file hashed against the Hub's etag, the sha256 of an LFS file, before it is
moved in place; a mismatch deletes it and fails the load). They land in the worker's weights store: a RunPod
network volume when the model names one (`CODERAI_WORKER_WEIGHTS_DIR`, set by the broker), whose index of pulled
files lets the next pod skip every file already there and verified. `store://` sources come from the head's model
store over the bus, as `store_path` does. Progress goes on the bus as `ModelFetch` events, so a cold start can be
watched and timed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal, cast

import msgspec
from coderai.catalog import CatalogError, Entry, ModelStore, Progress, Pulled, pull
from coderai.catalog.source import SourceError, parse_source
from coderai.contracts import ModelConfig, ModelFetch
from coderai.engine_worker.fetch import FetchError, Request, ensure_local

log = logging.getLogger("coderai.engine_worker")

PROGRESS_EVERY_S = 2.0  # between the events of each state, file and 10 % step
Publish = Callable[[ModelFetch], Awaitable[None]]
FetchState = Literal["resolving", "downloading", "verifying", "done", "failed"]  # ModelFetch.state


async def ensure_weights(
    config: ModelConfig, request: Request, models_dir: Path, store: ModelStore, publish: Publish, node_id: str
) -> ModelConfig:
    """`config` as this node loads it: unchanged when its `path` exists here; else pointing at its weights fetched by
    `source` into `store`, or (no source) from the head's store by `store_path` into `models_dir`."""
    if not config.source or os.path.exists(os.path.expanduser(config.path)):
        return await ensure_local(config, request, models_dir)
    try:
        src = parse_source(config.source)
    except SourceError as exc:
        raise FetchError(f"{config.name}: source: {exc}") from None
    report = _Reporter(publish, node_id, config)
    async with _fetching.setdefault((str(store.root), config.source), asyncio.Lock()):
        await report.send(Progress(name=config.name, state="resolving"))
        try:
            if src.kind == "store":
                got = await ensure_local(msgspec.structs.replace(config, store_path=src.path), request, store.root)
                path = got.path
            else:
                path = str(await _pull(src.entry(config.name, config.engine), store, report))
        except (FetchError, CatalogError, OSError) as exc:
            if not report.failed:
                await report.send(Progress(name=config.name, state="failed", error=str(exc)))
            raise FetchError(f"cannot fetch the weights of {config.name} from {config.source}: {exc}") from None
        if src.kind == "store":
            await report.send(Progress(name=config.name, state="done"))
    log.info("weights of %s from %s are in %s", config.name, config.source, path)
    return msgspec.structs.replace(config, path=path)


_fetching: dict[tuple[str, str], asyncio.Lock] = {}
"""One lock per store and source: a second copy of a model waits for the first one's fetch, then finds every file
verified in place, instead of racing it for the same partial file."""


async def _pull(entry: Entry, store: ModelStore, report: _Reporter) -> Path:
    """The catalogue's pull in a thread, its progress relayed in order to the bus; stopped (its partial files kept
    for a resume) when this task is cancelled, so a worker told to stop does not wait for a download."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Progress | None] = asyncio.Queue()
    relay = asyncio.create_task(report.relay(queue))
    cancel = threading.Event()

    def progress(p: Progress) -> None:  # called in the pull's thread
        loop.call_soon_threadsafe(queue.put_nowait, p)

    try:
        rec = await asyncio.to_thread(pull, entry, store, progress, cancel=cancel)
    finally:
        cancel.set()
        queue.put_nowait(None)
        await relay
    return model_path(store, rec)


def model_path(store: ModelStore, rec: Pulled) -> Path:
    """What a pulled source's `path` is: its main file, the one GGUF of a whole-repo pull, else the repo folder."""
    if rec.main:
        return store.model_path(rec)
    ggufs = [f for f in rec.files if f.endswith(".gguf")]
    return store.file_path(rec.repo, ggufs[0]) if len(ggufs) == 1 else store.repo_dir(rec.repo)


class _Reporter:
    """The pull's progress (many times a second) as `ModelFetch` events: each state or file change and each 10 %
    step, and every PROGRESS_EVERY_S between, so the EVENTS stream holds a cold start without a flood."""

    def __init__(self, publish: Publish, node_id: str, config: ModelConfig) -> None:
        self.publish, self.node_id, self.config = publish, node_id, config
        self.last: tuple[str, str, int] | None = None
        self.last_at = 0.0
        self.failed = False

    async def relay(self, queue: asyncio.Queue[Progress | None]) -> None:
        while (p := await queue.get()) is not None:
            await self.send(p)

    async def send(self, p: Progress) -> None:
        key, now = (p.state, p.file, int(p.percent // 10)), time.monotonic()
        if key == self.last and now - self.last_at < PROGRESS_EVERY_S:
            return
        self.last, self.last_at = key, now
        self.failed |= p.state == "failed"
        evt = ModelFetch(
            node_id=self.node_id,
            model=self.config.name,
            source=self.config.source,
            state=cast(FetchState, p.state),  # a pull's Progress.state is one of these (a plain str in its struct)
            file=p.file,
            bytes_done=p.bytes_done,
            bytes_total=p.bytes_total,
            rate_bps=p.rate_bps,
            error=p.error,
            ts=time.time(),
        )
        if p.state == "failed":
            log.error("fetching the weights of %s failed: %s", self.config.name, p.error)
        try:
            await self.publish(evt)
        except Exception as exc:  # a lost progress event must not fail the fetch it reports
            log.warning("could not publish the fetch progress of %s: %s", self.config.name, exc)
