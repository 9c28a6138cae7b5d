"""Where each model is loaded now, from the heartbeats the scheduler records in `coderai_nodes`, mirrored: `/v1/models`
and Ollama's `/api/ps` answer from memory, with no bus request per call."""

from __future__ import annotations

import time
from typing import NamedTuple

from coderai.contracts import EngineStatus, Heartbeat
from coderai.contracts.topology import NODE_TTL_S, NODES
from coderai.runtime.bus import Bus
from coderai.runtime.mirror import KVMirror


class Copy(NamedTuple):
    node_id: str
    status: EngineStatus

    @property
    def on_gpu(self) -> bool:
        """Started on named GPUs, or reporting a backend other than the CPU."""
        return bool(self.status.devices) or self.status.backend not in ("", "cpu")


class Copies:
    def __init__(self, bus: Bus) -> None:
        self.mirror = KVMirror(bus, NODES, Heartbeat, on_change=self._changed)
        self._heard: dict[str, float] = {}  # node record key -> when this gateway last saw it written

    def start(self) -> None:
        """(Re)start the watch; called at start and after a reconnect."""
        self.mirror.start()

    def stop(self) -> None:
        self.mirror.stop()

    def _changed(self, key: str, hb: Heartbeat | None) -> None:
        if hb is None:
            self._heard.pop(key, None)
        else:
            self._heard[key] = time.monotonic()

    def live(self, now: float | None = None) -> list[Heartbeat]:
        """The last heartbeat of each node heard from within NODE_TTL_S."""
        now = time.monotonic() if now is None else now
        return [hb for key, hb in self.mirror.values.items() if now - self._heard.get(key, float("-inf")) <= NODE_TTL_S]

    def by_model(self, now: float | None = None) -> dict[str, list[Copy]]:
        """Each model's engines on live nodes, in any state. The bucket's TTL drops a silent node's record without
        a word to watchers, so a record not written again within NODE_TTL_S is taken for gone here."""
        out: dict[str, list[Copy]] = {}
        for hb in self.live(now):
            for e in hb.engines:
                out.setdefault(e.model, []).append(Copy(hb.node_id, e))
        return out
