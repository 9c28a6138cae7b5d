"""The gateway's view of `coderai_models`, by model name, from a KV mirror."""

from __future__ import annotations

from coderai.contracts import ModelConfig, model_name
from coderai.contracts.topology import MODELS
from coderai.runtime.bus import Bus
from coderai.runtime.mirror import KVMirror


class Catalog:
    def __init__(self, bus: Bus) -> None:
        self.models: dict[str, ModelConfig] = {}
        self.mirror = KVMirror(bus, MODELS, ModelConfig, on_change=self._changed)

    def start(self) -> None:
        """(Re)start the watch; called at start and after a reconnect."""
        self.mirror.start()

    def stop(self) -> None:
        self.mirror.stop()

    def _changed(self, key: str, cfg: ModelConfig | None) -> None:
        if cfg is not None:
            self.models[cfg.name] = cfg
            return
        try:
            self.models.pop(model_name(key), None)
        except ValueError:
            pass
