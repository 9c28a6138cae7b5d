"""Changing the served models while the cluster runs: add, replace and remove them over the bus (the admin API,
`coderai models add|set|rm`, `pull --place`), or edit the models file, which is noticed within a second.

Every change goes to `coderai_models` at once (the gateway's catalogue mirrors it: a removed model is a 404 for
the next request, while the workers unload it only after its in-flight requests finish) and, when the scheduler
runs from a models file, into that file, so the file stays what a restart serves."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

from nats.aio.msg import Msg
from coderai import engine_params
from coderai.contracts import BusError, ModelConfig, encode, model_key
from coderai.contracts.admin import AddModelRequest, PlaceReply, RemoveModelRequest
from coderai.contracts.subjects import CMD_SCHEDULER_ADD, CMD_SCHEDULER_REMOVE
from coderai.models_file import ModelsFileError, entry, load_models, set_entry
from coderai.runtime.kv import put_if_changed
from coderai.scheduler.state import ModelRemoved, ModelSet

if TYPE_CHECKING:
    from coderai.scheduler.service import Scheduler

log = logging.getLogger("coderai.scheduler")

POLL_S = 1.0  # how often the models file's size, mtime and inode are looked at


def without_kept_exec(new: ModelConfig, old: ModelConfig | None) -> dict[str, Any]:
    """`new`'s params less the EXEC ones it keeps exactly as the served model has them (from the operator's models
    file): `coderai models set NAME replicas=2` sends the whole config back, and may, as long as it changes none."""
    if old is None or old.engine != new.engine:
        return new.params
    return {
        k: v
        for k, v in new.params.items()
        if not (k in engine_params.EXEC_PARAMS and k in old.params and old.params[k] == v)
    }


class LiveModels:
    """The scheduler's model set as it changes: `sched.models` (through `sched.apply`), its KV bucket and its models
    file kept in step."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.path = sched.settings.models_file
        self._lock = asyncio.Lock()  # one change at a time: the file, the list and the bucket move together
        self._stat = self._file_stat()
        self._from_file = {m.name: m for m in sched.models} if self.path else {}  # the file's, as last read

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        for subject, handler in ((CMD_SCHEDULER_ADD, self._add), (CMD_SCHEDULER_REMOVE, self._remove)):
            sub = await self.sched.connected_bus.serve(subject, handler, queue="scheduler")
            stack.push_async_callback(sub.unsubscribe)
        if self.path:
            task = asyncio.create_task(self._watch())
            stack.callback(task.cancel)

    async def _add(self, req: AddModelRequest, _m: Msg) -> PlaceReply:
        return await self.add(req.model, req.replace)

    async def add(self, new: ModelConfig, replace: bool = True) -> PlaceReply:
        """Serve `new` now, in place of a model of its name unless `replace` is false (the bus's add, and a
        fine-tuning job's model once it succeeds)."""
        if not new.name:
            raise BusError("bad_request", "a model needs a name", param="name")
        async with self._lock:
            old = self._served(new.name)
            if old is not None and not replace:
                raise BusError("conflict", f"a model named {new.name!r} is served already", param="name")
            try:  # params are data: each family's own, typed and in range; what runs a program, never from here
                engine_params.check(new.engine, without_kept_exec(new, old), operator=False)
            except engine_params.ParamError as exc:
                raise BusError("bad_request", exc.message, param=exc.param) from None
            self._write_back(new.name, new)
            await self.publish({new.name: new})
        log.info("%s model %s (%s)", "replaced" if old else "added", new.name, new.engine)
        return PlaceReply(model=new)

    async def _remove(self, req: RemoveModelRequest, _m: Msg) -> PlaceReply:
        """Stop serving `req.name`; the reply is the config it had."""
        async with self._lock:
            old = self._served(req.name)
            if old is None:
                raise BusError("not_found", f"no model {req.name!r}", param="name")
            self._write_back(req.name, None)
            await self.publish({req.name: None})
        log.info("removed model %s", req.name)
        return PlaceReply(model=old)

    def _served(self, name: str) -> ModelConfig | None:
        return next((m for m in self.sched.models if m.name == name), None)

    def _write_back(self, name: str, cfg: ModelConfig | None) -> None:
        """Put the change into the models file first: a change the file cannot take is refused, not half made."""
        if not self.path:
            return
        try:
            set_entry(self.path, name, None if cfg is None else entry(cfg))
        except ValueError as exc:
            raise BusError("bad_request", f"model {name!r} cannot be written to the models file: {exc}") from None
        except (ModelsFileError, OSError) as exc:
            raise BusError("unavailable", f"the models file cannot be changed ({exc}); fix it and try again") from None
        self._stat = self._file_stat()  # our own write: nothing for the watch to reload
        if cfg is None:
            self._from_file.pop(name, None)
        else:
            self._from_file[name] = cfg

    async def publish(self, changes: dict[str, ModelConfig | None]) -> None:
        """Publish each change (None: removed) and have the next assignment pass place or unload copies; the models
        file is left as it is."""
        s = self.sched
        for name, cfg in changes.items():
            if cfg is None:
                await s.kv_models.delete(model_key(name))
                s.apply(ModelRemoved(name))
            else:
                await put_if_changed(s.kv_models, model_key(name), encode(cfg))
                s.apply(ModelSet(cfg))
        s._dirty.set()

    def _file_stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(os.path.expanduser(self.path))
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino  # the inode: an editor that saves by renaming a new file

    async def _watch(self) -> None:
        """Reload the models file when it changes; publish what differs from its last reading."""
        while True:
            await asyncio.sleep(POLL_S)
            if self._file_stat() == self._stat:
                continue
            async with self._lock:  # read under the lock: a write-back in between would be undone otherwise
                self._stat = self._file_stat()  # an invalid file is reported once, not every second
                try:
                    models = load_models(self.path)
                except ModelsFileError as exc:
                    log.warning("the models file changed but is invalid, so nothing changes: %s", exc)
                    continue
                new = {m.name: m for m in models}
                changes: dict[str, ModelConfig | None] = {n: m for n, m in new.items() if self._from_file.get(n) != m}
                changes |= {n: None for n in self._from_file if n not in new}
                if not changes:
                    continue
                try:
                    await self.publish(changes)
                except Exception as exc:  # the bus may be reconnecting: read the file again
                    log.warning("publishing the models file's changes failed (%s); retrying", exc)
                    self._stat = None
                    continue
                self._from_file = new
            log.info(
                "models file changed: %s",
                ", ".join(f"{'removed' if m is None else 'set'} {n}" for n, m in sorted(changes.items())),
            )
