"""`coderai models check NAME`: can this model burst to a rented pod, and if not, why not.

A pod has none of the operator's folders, so it serves a model only when its policy lets it burst, its worker can
fetch the weights (by `source`, or from the head's store by `store_path`), and some GPU type holds it. Each is a
Finding. What cannot be asked is `skipped`, saying why (the Hub unreachable: offline; no RunPod key to list GPU
types), and does not count against the model: only a `no` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx
import msgspec

from coderai.catalog.errors import CatalogError, MissingExtra, Unreachable
from coderai.catalog.pull import plan
from coderai.catalog.source import SourceError, parse_source
from coderai.contracts import ModelConfig

GB = 1 << 30
_GPU_TYPES = "query GpuTypes { gpuTypes { id displayName memoryInGb } }"


@dataclass(frozen=True)
class Finding:
    """One answer: `topic` policy, weights or size; `status` ok, no (it cannot burst) or skipped (not asked)."""

    topic: str
    status: Literal["ok", "no", "skipped"]
    text: str


@dataclass(frozen=True)
class Gpu:
    """A RunPod GPU type and its memory (one card)."""

    id: str
    memory_gb: float


class BrokerView(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of the pod-broker's settings a check needs, read from the same variables as the broker's own
    BrokerSettings (a library may not import a service's module)."""

    runpod_api_key: str = ""
    runpod_api_base: str = "https://api.runpod.io"
    hf_token: str = ""


def check_model(
    m: ModelConfig, *, store_root: Path, endpoint: str | None, token: str | None, gpus: list[Gpu] | str
) -> list[Finding]:
    """The findings for `m`: its policy, where a pod gets its weights (asking the Hub with `endpoint` and `token`,
    or looking in the head's model store at `store_root`), and whether a GPU type of `gpus` (or why there is no
    list) holds it."""
    weights, size = _weights(m, store_root, endpoint, token)
    return [_policy(m), weights, _size(m, size, gpus)]


def _policy(m: ModelConfig) -> Finding:
    p = m.pod
    if p.burst == "never" and not p.min_pods:
        return Finding(
            "policy",
            "no",
            'pod.burst is "never" (the default) and it keeps no min_pods: it is never '
            "sent to a pod; set pod.burst (docs/pods.md)",
        )
    caps = f", at most ${p.max_hourly_usd:g}/h a pod" if p.max_hourly_usd else ""
    budget = f", ${p.budget_usd:g} a {p.period}" if p.budget_usd else ""
    return Finding("policy", "ok", f"pod.burst = {p.burst}, {p.min_pods} to {p.max_pods} pods{caps}{budget}")


def _weights(m: ModelConfig, store_root: Path, endpoint: str | None, token: str | None) -> tuple[Finding, int | None]:
    """Where a pod's worker gets the files, and their size in bytes (None: not known)."""
    if not m.source:
        if m.store_path:
            return _in_store(f"store_path {m.store_path}", m.store_path, store_root)
        return Finding(
            "weights",
            "no",
            f"no source: a pod has no copy of {m.path}; set source = "
            '"hf://<org>/<repo>[/<file>][@<revision>]", a catalogue id or "store://<path>" '
            "(docs/pods.md)",
        ), None
    try:
        src = parse_source(m.source)
    except SourceError as exc:
        return Finding("weights", "no", f"source: {exc}"), None
    if src.kind == "store":
        return _in_store(m.source, src.path, store_root)
    where = endpoint or "huggingface.co"
    try:
        metas = plan(src.entry(m.name, m.engine), endpoint, token)
    except (Unreachable, MissingExtra) as exc:
        return Finding("weights", "skipped", f"{m.source}: not checked: {exc}"), None
    except CatalogError as exc:
        return Finding("weights", "no", f"{m.source}: {exc}"), None
    size = sum(meta.size or 0 for _, meta in metas.values())
    names = ", ".join(list(metas)[:3]) + (f" and {len(metas) - 3} more" if len(metas) > 3 else "")
    return Finding(
        "weights", "ok", f"{m.source}: {names} on {where} ({size / GB:.2f} GB); the pod fetches and verifies them"
    ), size


def _in_store(what: str, path: str, root: Path) -> tuple[Finding, int | None]:
    """A file or folder ("/" at the end) of the head's model store, looked up on this machine."""
    local = root / path.removesuffix("/")
    if not local.exists():
        return Finding(
            "weights",
            "no",
            f"{what}: not in the head's model store {root} (run this on the head, or give its --data-dir)",
        ), None
    files = [f for f in local.rglob("*") if f.is_file()] if local.is_dir() else [local]
    size = sum(f.stat().st_size for f in files)
    return Finding(
        "weights", "ok", f"{what}: in the head's model store ({size / GB:.2f} GB); the pod fetches it over the bus"
    ), size


def _size(m: ModelConfig, weights: int | None, gpus: list[Gpu] | str) -> Finding:
    from coderai.sizing import estimate_bytes

    count = m.pod.gpu_count
    if m.memory_mb:
        need, unset = m.memory_mb << 20, ""
    elif weights:
        need = estimate_bytes(m, weights)
        unset = " (estimated: memory_mb is not set, and the broker then rents the cheapest GPU whatever the size)"
    else:
        return Finding("size", "skipped", "not checked: the weights' size is unknown and memory_mb is not set")
    needs = f"needs about {need / GB:.1f} GB{unset}"
    if isinstance(gpus, str):
        return Finding("size", "skipped", f"{needs}; GPU types not checked: {gpus}")
    holds = [g for g in gpus if g.memory_gb * GB * count >= need]
    if not holds:
        big = max(gpus, key=lambda g: g.memory_gb, default=None)
        largest = f" (the largest: {big.id}, {big.memory_gb:g} GB)" if big else ""
        return Finding(
            "size", "no", f"{needs}: no RunPod GPU type holds that in {count} GPU(s){largest}; raise pod.gpu_count"
        )
    return Finding("size", "ok", f"{needs}: {len(holds)} of {len(gpus)} RunPod GPU types hold it in {count} GPU(s)")


def runpod_gpus(view: BrokerView, timeout_s: float = 10.0) -> list[Gpu] | str:
    """RunPod's GPU types and their memory, asked with the broker's API key; a string saying why not instead."""
    if not view.runpod_api_key:
        return "no RunPod API key (CODERAI_POD_BROKER_RUNPOD_API_KEY or RUNPOD_API_KEY)"
    url = view.runpod_api_base.rstrip("/") + "/graphql"
    try:
        r = httpx.post(
            url,
            json={"query": _GPU_TYPES},
            timeout=timeout_s,
            headers={"Authorization": f"Bearer {view.runpod_api_key}", "User-Agent": "coderai-models-check"},
        )
        body = r.json() if r.status_code == 200 else None
    except httpx.TransportError as exc:
        return f"{httpx.URL(url).host} unreachable (offline?): {type(exc).__name__}"
    except ValueError:
        body = None
    types = ((body or {}).get("data") or {}).get("gpuTypes") if isinstance(body, dict) else None
    if not isinstance(types, list):
        return f"RunPod answered HTTP {r.status_code} without GPU types"
    return [Gpu(g["id"], float(g.get("memoryInGb") or 0)) for g in types if isinstance(g, dict) and g.get("id")]
