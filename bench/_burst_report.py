"""The burst bench's record of one cold start and its markdown report (bench/burst.py)."""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

PHASES = ("rent", "boot", "join", "fetch", "load", "first_token")


@dataclass
class Round:
    """One cold start: its milestones (wall clock) and what they split into, and its baselines."""

    kind: str
    group: str  # the report's row
    model: str
    pod: str
    gpu_type: str
    engine: str
    milestones: dict[str, float]
    phases: dict[str, float]
    total_s: float
    other_s: float
    downloaded: bool  # the pod downloaded (and hashed) the file; False: it found it verified on the volume
    fetch_resolve_s: float
    fetch_download_s: float
    fetch_verify_s: float
    fetch_bytes: int
    fetch_progress: list[tuple[float, int]]  # (seconds since the download began, bytes done) per event
    load_s: float  # the worker's own measure of the engine load (ModelLoaded.load_s, the fetch not included)
    warm_ttft_s: list[float]
    plain_get_s: float
    plain_get_sha_s: float

    @property
    def warm_s(self) -> float:
        return statistics.median(self.warm_ttft_s)


def loadavg() -> str:
    """The machine's 1-minute load average: other work on a shared box shows in every phase."""
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(
    rounds: list[Round], files: dict[str, int], a: argparse.Namespace, wall_s: float, load: tuple[str, str]
) -> str:
    of: dict[str, list[Round]] = {}
    for r in rounds:
        of.setdefault(r.group, []).append(r)
    size = {r.group: files[r.kind] for r in rounds}
    out = [
        f"## Burst cold start ({'smoke' if a.smoke else 'full'} run, {wall_s:.0f}s)",
        "",
        f"Machine: {os.cpu_count()} CPUs, load average {load[0]} before the run and {load[1]} after. Fake RunPod "
        "API (pods are local engine-worker processes, no image pull), weights from a local Hub-like server. "
        "Median of the cold starts in each row, each on a fresh pod (n); the volume rows are pods that found the "
        "weights on the network volume an earlier pod filled. Warm: median of "
        f"{a.warm} streamed requests per round to the pod once warm, each prompt new. Seconds; `max_tokens` "
        f"{a.max_tokens}.",
        "",
        "| model | n | GGUF MB | rent | boot | join | fetch | load | first token | other | total (request → "
        "first token) | best total | warm TTFT | cold / warm |",
        "|---|---:|---:|" + "---:|" * 11,
    ]
    for k, rs in of.items():
        ph = {p: med([r.phases[p] for r in rs]) for p in PHASES}
        total, warm = med([r.total_s for r in rs]), med([r.warm_s for r in rs])
        out.append(
            f"| {k} | {len(rs)} | {size[k] / 1e6:.1f} | "
            + " | ".join(f"{ph[p]:.3f}" for p in PHASES)
            + f" | {med([r.other_s for r in rs]):.3f} | {total:.2f} | {min(r.total_s for r in rs):.2f} "
            f"| {warm:.3f} | {total / warm:.0f}x |"
        )
    out += [
        "",
        "Fetch against a plain download of the same file from the same server, by a process of its own, "
        "right before or after each cold start, alternately (median of rounds, and the best download against "
        "the best GET). The "
        "fetch's parts: resolve (Hub metadata: model info and a HEAD of the file, huggingface_hub imported), "
        "download, verify (sha256) and store. MB/s over the file's size:",
        "",
        "| model | fetch | resolve | download | verify + store | plain GET | plain GET + sha256 "
        "| fetch / (GET + sha256) | download / GET | best download / best GET | fetch MB/s | GET MB/s |",
        "|---|" + "---:|" * 11,
    ]
    for k, rs in of.items():
        if not all(r.plain_get_s for r in rs):
            continue  # the weights were on the volume: nothing was downloaded
        fetch, res, dl, ver = (
            med([r.phases["fetch"] for r in rs]),
            med([r.fetch_resolve_s for r in rs]),
            med([r.fetch_download_s for r in rs]),
            med([r.fetch_verify_s for r in rs]),
        )
        get, get_sha = med([r.plain_get_s for r in rs]), med([r.plain_get_sha_s for r in rs])
        best = min(r.fetch_download_s for r in rs) / min(r.plain_get_s for r in rs)
        mb = size[k] / 1e6
        out.append(
            f"| {k} | {fetch:.3f} | {res:.3f} | {dl:.3f} | {ver:.3f} | {get:.3f} | {get_sha:.3f} "
            f"| {fetch / get_sha:.2f}x | {dl / get:.2f}x | {best:.2f}x | {mb / fetch:.0f} | {mb / get:.0f} |"
        )
    out += [
        "",
        "Each cold start (a 0 plain GET: the weights were on the volume, none was made):",
        "",
        "| model | pod | GPU type | rent | boot | join | fetch | load | first token | total | warm TTFT "
        "| fetch's download | plain GET |",
        "|---|---|---|" + "---:|" * 10,
    ]
    for r in rounds:
        out.append(
            f"| {r.model} | {r.pod} | {r.gpu_type} | "
            + " | ".join(f"{r.phases[p]:.3f}" for p in PHASES)
            + f" | {r.total_s:.2f} | {r.warm_s:.3f} | {r.fetch_download_s:.3f} | {r.plain_get_s:.3f} |"
        )
    return "\n".join(out)
