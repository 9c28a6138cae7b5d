"""The gateway's view of `coderai_models`: kept current by a KV watch, read without I/O per request."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from coderai.contracts import ModelConfig, decode
from coderai.contracts.topology import MODELS
from coderai.runtime.bus import Bus

log = logging.getLogger("coderai.gateway")


class Catalog:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.models: dict[str, ModelConfig] = {}
        self.synced = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """(Re)start the watch; called at start and after a reconnect."""
        if self._task is not None:
            self._task.cancel()
        self._task = asyncio.create_task(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        while True:
            watcher = None
            try:
                kv = await self.bus.kv(MODELS)
                watcher = await kv.watch(">")
                while True:
                    entry = await watcher.updates(timeout=None)
                    if entry is None:
                        self.synced.set()
                        continue
                    if entry.operation in ("DEL", "PURGE") or not entry.value:
                        self._drop(entry.key)
                        continue
                    try:
                        cfg = decode(entry.value, ModelConfig)
                    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                        log.error("bad model config under %s: %s", entry.key, exc)
                        continue
                    self.models[cfg.name] = cfg
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - restarted; the cached models stay served meanwhile
                log.warning("model catalog watch ended (%s); restarting", exc)
                await asyncio.sleep(0.5)
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()

    def _drop(self, key: str) -> None:
        from coderai.contracts import model_name

        try:
            self.models.pop(model_name(key), None)
        except ValueError:
            pass
