"""Pure stage planning for relayed video: which live node runs encode, each denoise range, and decode.

Each stage needs one part of the model in memory: encode the text encoder (and tokenizer), denoise the UNet,
decode the VAE. A part's size is read from the model folder's component subfolder (x 1.2 plus 256 MB, as
placement estimates); a node offers its free GPU memory when it reports a GPU, else its free RAM, less what this
plan already put there (a part stays loaded after its stage). Candidates are nodes with a ready engine of the
model, minus `exclude` (a stage there just died). The biggest part is placed first; each stage is spread to the
node with the fewest stages of this plan, then the most room, then by name, so three nodes get encode, denoise
and decode one each.

The stage structure depends only on the steps and `denoise_parts`, never on the nodes: a re-plan after a death
has the same stages, so the driver can continue from the stage that failed.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass

from coderai.contracts import Heartbeat, ModelConfig
from coderai.contracts.stages import RESUMABLE_SCHEDULERS as RESUMABLE
from coderai.contracts.stages import Stage, StageKind, StagePlan, StagePlanRequest
from coderai.sizing import MB, OVERHEAD, UNKNOWN_CAPACITY, path_bytes

PART_DIRS: dict[StageKind, tuple[str, ...]] = {
    "encode": ("text_encoder", "tokenizer"),
    "denoise": ("unet",),
    "decode": ("vae",),
}


class NoStagePlan(Exception):
    """No live node can run one of the stages."""


@dataclass(frozen=True)
class ModelParts:
    """Bytes each stage's part needs, and the scheduler class (whether a denoise may be split)."""

    need: dict[str, int]
    scheduler: str = ""


def model_parts(path: str) -> ModelParts:
    """Sizes from the model folder on this machine; a folder that is not here counts the overhead alone."""
    path = os.path.expanduser(path)
    need = {
        kind: int(sum(path_bytes(os.path.join(path, d)) for d in dirs) * 1.2) + OVERHEAD
        for kind, dirs in PART_DIRS.items()
    }
    try:
        with open(os.path.join(path, "scheduler", "scheduler_config.json"), encoding="utf-8") as fh:
            scheduler = str(json.load(fh).get("_class_name", ""))
    except (OSError, ValueError):
        scheduler = ""
    return ModelParts(need=need, scheduler=scheduler)


def denoise_parts(m: ModelConfig) -> int:
    """How many stages the denoise is cut into: `params.stages = N` (a number), else 1 (`stages = true`)."""
    opt = m.params.get("stages")
    if isinstance(opt, int) and not isinstance(opt, bool):
        return max(1, opt)
    return 1


def structure(steps: int, parts: int) -> list[tuple[StageKind, int, int]]:
    """(kind, start, end) of every stage: encode, `parts` denoise ranges as even as can be, decode."""
    parts = max(1, min(parts, steps))
    cuts = [round(i * steps / parts) for i in range(parts + 1)]
    denoise: list[tuple[StageKind, int, int]] = [("denoise", a, b) for a, b in itertools.pairwise(cuts)]
    return [("encode", 0, 0), *denoise, ("decode", steps, steps)]


def room(hb: Heartbeat) -> int:
    """What a node has free now: GPU memory when it reports a GPU, else RAM; unknown is not refused."""
    free = hb.vram_free if hb.vram_total else hb.mem_free
    return free if free else UNKNOWN_CAPACITY


def plan_stages(req: StagePlanRequest, m: ModelConfig, nodes: dict[str, Heartbeat], parts: ModelParts) -> StagePlan:
    """The plan for one job, or NoStagePlan naming the stage nobody can run."""
    if req.steps < 1:
        raise NoStagePlan(f"a video needs at least one step, got {req.steps}")
    engines: dict[str, str] = {}
    for n, hb in sorted(nodes.items()):
        if n in req.exclude:
            continue
        for e in hb.engines:
            if e.model == m.name and e.state == "ready":
                engines[n] = e.engine_id
    if not engines:
        gone = f" (excluded: {', '.join(req.exclude)})" if req.exclude else ""
        raise NoStagePlan(f"no live node has model {m.name!r} ready{gone}")
    split = denoise_parts(m) if parts.scheduler in RESUMABLE else 1
    free = {n: room(nodes[n]) for n in engines}
    count = {n: 0 for n in engines}
    holds: dict[str, set[str]] = {n: set() for n in engines}
    shape = structure(req.steps, split)
    chosen: dict[int, str] = {}
    # the biggest part first, so the one node that can hold the UNet is not taken by the text encoder
    for i in sorted(range(len(shape)), key=lambda i: (-parts.need.get(shape[i][0], OVERHEAD), i)):
        kind = shape[i][0]
        need = parts.need.get(kind, OVERHEAD)
        fits = [n for n in engines if kind in holds[n] or free[n] >= need]
        if not fits:
            raise NoStagePlan(f"no node has room for the {kind} stage of {m.name!r} ({need // MB} MB)")
        n = chosen[i] = min(fits, key=lambda x: (count[x], -free[x], x))
        if kind not in holds[n]:
            holds[n].add(kind)
            free[n] -= need
        count[n] += 1
    stages = [
        Stage(index=i, kind=kind, start=start, end=end, node=chosen[i], engine_id=engines[chosen[i]])
        for i, (kind, start, end) in enumerate(shape)
    ]
    return StagePlan(job_id=req.job_id, model=m.name, steps=req.steps, stages=stages)
