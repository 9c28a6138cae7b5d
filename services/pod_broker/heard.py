"""What the pod broker heard from its pods' workers: each one's last heartbeat, and when it first said it was leaving
(its SIGTERM: RunPod sends it as it takes a spot pod's GPU back), which is when a preempted pod stopped billing."""

from __future__ import annotations

import time

from coderai.contracts import Heartbeat

# a stopping worker is quiet within its drain (30 s): one still heard this long after it said it was leaving was not
LEAVING_S = 35.0


class Heard:
    def __init__(self) -> None:
        self.last: dict[str, tuple[float, Heartbeat]] = {}  # pod -> (monotonic time heard, its last heartbeat)
        self.left: dict[str, float] = {}  # pod -> when its first `leaving` heartbeat came (wall time)

    def note(self, hb: Heartbeat, live: bool) -> None:
        """A pod's heartbeat; the first `leaving` one of a `live` pod (one the broker still runs) is remembered."""
        self.last[hb.node_id] = (time.monotonic(), hb)
        if hb.leaving and live:
            self.left.setdefault(hb.node_id, time.time())

    def recent(self, name: str, ttl_s: float) -> Heartbeat | None:
        """The pod's last heartbeat, if heard within `ttl_s`."""
        seen = self.last.get(name)
        return seen[1] if seen and time.monotonic() - seen[0] <= ttl_s else None

    def stopped_at(self, name: str) -> float | None:
        """When a preempted pod stopped running, as heard (wall time): when its worker said it was leaving, if it then
        went quiet as a stopping worker does (a pod that says so and heartbeats on does not end its own bill early);
        else its last heartbeat; None: never heard from."""
        seen = self.last.get(name)
        last = time.time() - (time.monotonic() - seen[0]) if seen is not None else None
        left = self.left.get(name)
        if left is not None and (last is None or last - left <= LEAVING_S):
            return left
        return last

    def forget(self, name: str) -> None:
        self.last.pop(name, None)
        self.left.pop(name, None)
