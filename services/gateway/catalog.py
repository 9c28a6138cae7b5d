"""The gateway's view of `coderai_models`, by model name, from a KV mirror."""

from __future__ import annotations

import contextlib

from coderai.contracts import ModelConfig, model_name
from coderai.contracts.topology import MODELS
from coderai.runtime.bus import Bus
from coderai.runtime.lifecycle import wait_for
from coderai.runtime.mirror import KVMirror


class Catalog:
    """`models` by name. A name missing from it is unknown only while the view is `complete`: whole, following the
    bucket, over a connected bus. Otherwise (a gateway just started, a reconnect, a failover of the bucket's stream)
    the view is being rebuilt, and a missing name may exist: a caller waits for it (`wait_complete`) instead of
    answering 404."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.models: dict[str, ModelConfig] = {}
        self.mirror = KVMirror(bus, MODELS, ModelConfig, on_change=self._changed)

    def start(self) -> None:
        """(Re)start the watch; called at start and after a reconnect."""
        self.mirror.start()

    def stop(self) -> None:
        self.mirror.stop()

    @property
    def complete(self) -> bool:
        return self.mirror.current.is_set() and self.bus.connected

    async def wait_complete(self, timeout_s: float) -> bool:
        """Whether the view is complete, waiting up to `timeout_s` for it (polled: a reconnect of the bus sets no
        event here)."""
        with contextlib.suppress(TimeoutError):
            await wait_for(lambda: self.complete, timeout_s, what="a whole catalogue")
        return self.complete

    def _changed(self, key: str, cfg: ModelConfig | None) -> None:
        if cfg is not None:
            self.models[cfg.name] = cfg
            return
        try:
            self.models.pop(model_name(key), None)
        except ValueError:
            pass
