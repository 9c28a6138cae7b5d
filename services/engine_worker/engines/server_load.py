"""What a server child says about its own load: requests running, requests waiting, and how full its KV cache is.

Read from the server's Prometheus text (`/metrics`: llama-server's `llamacpp:*`, vLLM's `vllm:*`) and, for a
llama-server build without a KV metric, from its `/slots`. The worker puts them in the heartbeat (`slots_busy`,
`queued`, `kv_used`), where the router counts them into an engine's load and keeps new conversations off an engine
whose cache is nearly full. Each read is best-effort: a server that does not answer, or answers something else,
reads as idle and unknown (zeros), and the worker's own in-flight count still stands.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from coderai.engine_worker.engines.child_server import POLL_S, ChildServer

LLAMA_RUNNING = "llamacpp:requests_processing"
LLAMA_WAITING = "llamacpp:requests_deferred"
LLAMA_KV = "llamacpp:kv_cache_usage_ratio"  # llama.cpp builds before mid-2025; later ones have /slots only
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # the name since v1, the one before (both 0..1)


@dataclass(frozen=True)
class ServerLoad:
    """Requests the server runs now, requests it holds waiting, the share of its KV cache they use (0..1)."""

    running: int = 0
    waiting: int = 0
    kv_used: float = 0.0  # 0 also when not known

    def stats(self) -> dict[str, Any]:
        """The heartbeat's `EngineStatus` fields."""
        return {"slots_busy": self.running, "queued": self.waiting, "kv_used": round(self.kv_used, 4)}


def samples(text: str, names: Iterable[str]) -> dict[str, list[float]]:
    """The values of the named metrics in Prometheus text, one per label set (`name{labels} value [ts]`)."""
    wanted = set(names)
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        if brace >= 0:
            name, rest = line[:brace], line[line.rfind("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        if name not in wanted:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            out.setdefault(name, []).append(value)
    return out


def share(value: float) -> float:
    """A fraction clamped to 0..1; NaN (or anything not a number) is 0, not known."""
    return min(1.0, max(0.0, value)) if value == value else 0.0


MAX_COUNT = 1 << 20  # requests a server is believed to hold at most, whatever it says


def _count(values: list[float] | None) -> int:
    return int(min(MAX_COUNT, max(0.0, sum(values)))) if values else 0


def llama_load(metrics: str, slots: object = None) -> ServerLoad:
    """llama-server's load from its /metrics text; the KV share from `llamacpp:kv_cache_usage_ratio` when the build
    has it, else from its /slots (decoded JSON) when given."""
    found = samples(metrics, (LLAMA_RUNNING, LLAMA_WAITING, LLAMA_KV))
    kv = found.get(LLAMA_KV)
    used = share(max(kv)) if kv else slots_kv(slots)
    return ServerLoad(_count(found.get(LLAMA_RUNNING)), _count(found.get(LLAMA_WAITING)), used)


def slots_kv(slots: object) -> float:
    """The share of llama-server's context that its running requests hold, from /slots: each processing slot holds
    `n_prompt_tokens` (its prompt and what it generated so far) of its `n_ctx`. An idle slot's cached prompt is not
    counted: the next request that needs the room takes it."""
    if not isinstance(slots, list):
        return 0.0
    held = total = 0
    for s in slots:
        if not isinstance(s, dict):
            continue
        n_ctx, tokens = s.get("n_ctx"), s.get("n_prompt_tokens")
        if not isinstance(n_ctx, int) or n_ctx <= 0:
            continue
        total += n_ctx
        if s.get("is_processing") is True and isinstance(tokens, int):
            held += min(max(0, tokens), n_ctx)
    return held / total if total else 0.0


def vllm_load(metrics: str) -> ServerLoad:
    """vLLM's load from its /metrics text: running and waiting summed over its engines (data parallel), the KV share
    their mean."""
    found = samples(metrics, (VLLM_RUNNING, VLLM_WAITING, *VLLM_KV))
    kv = next((found[n] for n in VLLM_KV if n in found), [])
    return ServerLoad(
        _count(found.get(VLLM_RUNNING)), _count(found.get(VLLM_WAITING)), share(sum(kv) / len(kv)) if kv else 0.0
    )


def read_llama(probe: httpx.Client, base_url: str) -> ServerLoad:
    """One read of a llama-server's load (/metrics, and /slots when the build has no KV metric)."""
    r = probe.get(f"{base_url}/metrics")
    if r.status_code != 200:
        return ServerLoad()
    load = llama_load(r.text)
    if LLAMA_KV in r.text:
        return load
    s = probe.get(f"{base_url}/slots")
    if s.status_code != 200:
        return load
    try:
        return llama_load(r.text, s.json())
    except ValueError:  # not JSON: the KV share stays unknown
        return load


def read_vllm(probe: httpx.Client, base_url: str) -> ServerLoad:
    """One read of a vLLM server's load (/metrics)."""
    r = probe.get(f"{base_url}/metrics")
    return vllm_load(r.text) if r.status_code == 200 else ServerLoad()


class LoadPoll:
    """Reads a child's load every `poll_s` on a daemon thread of its own, for an engine whose child has no supervisor
    (whose `on_alive` would do it); `load` is the last read, zeros while the child does not answer."""

    def __init__(
        self,
        child: ChildServer,
        read: Callable[[httpx.Client, str], ServerLoad],
        poll_s: float = POLL_S,
    ) -> None:
        self.child = child
        self.read = read
        self.poll_s = poll_s
        self.load = ServerLoad()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"load-{child.log_name}-{child.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=2.0, headers=self.child.headers) as probe:
            while not self._stop.wait(self.poll_s):
                try:
                    self.load = self.read(probe, self.child.base_url) if self.child.running() else ServerLoad()
                except httpx.HTTPError:
                    self.load = ServerLoad()  # gone or restarting: its next answer says

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)
