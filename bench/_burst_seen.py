"""What the burst bench (bench/burst.py) sees: the bus's events as they arrive, and the fake RunPod API's pods,
each a real engine worker whose start is recorded."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from coderai.contracts import Heartbeat, ModelFetch, ModelLoaded, PodEvent
from coderai.contracts.subjects import EVT_MODEL_FETCH, EVT_MODEL_LOADED, EVT_POD, HEARTBEAT
from coderai.runtime.bus import Bus


@dataclass
class Seen:
    """Every event this run cares about, as it arrives: first heartbeat per node, fetch progress per node, loads
    per node, pods created per model."""

    first_hb: dict[str, float] = field(default_factory=dict)
    fetches: dict[str, list[ModelFetch]] = field(default_factory=dict)
    loaded: dict[str, ModelLoaded] = field(default_factory=dict)
    created: dict[str, PodEvent] = field(default_factory=dict)
    billed: set[str] = field(default_factory=set)  # pods the broker has terminated and billed
    failed: dict[str, str] = field(default_factory=dict)  # model -> why its pod cannot serve it
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def listen(self, bus: Bus) -> None:
        async def on_hb(hb: Heartbeat, _m) -> None:
            self.first_hb.setdefault(hb.node_id, hb.ts)
            for e in hb.engines:
                if e.state == "failed":
                    self.failed.setdefault(e.model, f"{hb.node_id}: engine failed: {e.error}")
            self.changed.set()

        async def on_fetch(evt: ModelFetch, _m) -> None:
            self.fetches.setdefault(evt.node_id, []).append(evt)
            if evt.state == "failed":
                self.failed.setdefault(evt.model, f"{evt.node_id}: fetch failed: {evt.error}")
            self.changed.set()

        async def on_loaded(evt: ModelLoaded, _m) -> None:
            self.loaded.setdefault(evt.node_id, evt)
            self.changed.set()

        async def on_pod(evt: PodEvent, _m) -> None:
            if evt.what == "created":
                self.created.setdefault(evt.model, evt)
            elif evt.what == "billed":
                self.billed.add(evt.name)
            self.changed.set()

        for subject, handler in (
            (HEARTBEAT, on_hb),
            (EVT_MODEL_FETCH, on_fetch),
            (EVT_MODEL_LOADED, on_loaded),
            (EVT_POD, on_pod),
        ):
            await bus.listen(subject, handler, subject_str=subject.wildcard())

    async def until(self, predicate, timeout_s: float, what: str):
        """`predicate()`'s value once it is truthy, woken by each event; TimeoutError naming `what` after
        `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not (got := predicate()):
            self.changed.clear()
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"no {what} within {timeout_s:.0f}s")
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                pass
        return got


def pod_launcher(pod_dir: Path, volume_dir: Path, hub, started: dict[str, float]):
    """The fake's `launch`: a real engine worker per pod (`worker_pods`), pointed at the local Hub, recording
    when its process was started. A network volume (mounted at /workspace on RunPod) is `volume_dir` here, one
    folder every pod shares."""
    from coderai.testing.fake_hub import hub_env
    from coderai.testing.fake_runpod import worker_pods

    inner = worker_pods(pod_dir)

    def launch(env: dict[str, str]):
        name = env.get("CODERAI_NODE_ID") or env["RUNPOD_POD_ID"]
        env = {**env, **hub_env(hub, str(pod_dir / name / "hf"))}
        if "CODERAI_WORKER_WEIGHTS_DIR" in env:
            env["CODERAI_WORKER_WEIGHTS_DIR"] = str(volume_dir / env["CODERAI_WORKER_WEIGHTS_DIR"].lstrip("/"))
        proc = inner(env)
        started[name] = time.time()
        return proc

    return launch
