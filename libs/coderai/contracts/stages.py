"""Stage relay: one video generation split into stages (encode, denoise steps a..b, decode) on several nodes.

A model whose parts fit no single card still fits part by part. The scheduler answers a `StagePlan` (which
engine runs which stage); the gateway sends each stage a `StageJob` and gets back a `StageDone` whose `Handoff`
names the tensors the stage left in the `coderai_blobs` object store. The next stage checks the handoff
(`check_handoff`) before it runs, so a mismatch is a clear error, never a crash deep inside a UNet. A stage
whose node dies is run again elsewhere from the last stored handoff; the job never starts from zero.
"""

from __future__ import annotations

from typing import Literal, Union

from coderai.contracts.base import Message, RequestId
from coderai.contracts.errors import ErrorReply
from coderai.contracts.jobs import Chunk, KeepAlive, Usage
from coderai.contracts.media import Blob, VideoJob

StageKind = Literal["encode", "denoise", "decode"]

RESUMABLE_SCHEDULERS = frozenset({"DDIMScheduler", "DDPMScheduler"})
"""diffusers schedulers whose state between two steps is only (timesteps, step index, latents, generator): a
denoise with one of them may stop after any step and go on on another node. Others run it in one stage."""

DTYPES = ("float32", "float16", "bfloat16", "float64", "uint8", "int64")
"""Tensor dtypes a handoff may carry (torch names)."""


class Stage(Message, frozen=True, kw_only=True):
    """One stage of a plan: `kind`, for denoise the steps `start` .. `end` (end exclusive), where it runs."""

    index: int
    kind: StageKind
    start: int = 0
    end: int = 0
    node: str
    engine_id: str


class StagePlan(Message, frozen=True, kw_only=True, tag="stage_plan", tag_field="t"):
    """The ordered stages of one job; denoise ranges cover 0 .. `steps` without gap or overlap."""

    job_id: str
    model: str
    steps: int
    stages: list[Stage]


class StagePlanRequest(Message, frozen=True, kw_only=True):
    """Ask the scheduler for a plan; `exclude`: nodes not to use (a stage there just died)."""

    job_id: str
    model: str
    steps: int
    exclude: list[str] = []


class TensorRef(Message, frozen=True, kw_only=True):
    """A tensor in the object store: raw bytes in C order, checked against `sha256` when read back."""

    object: str
    shape: list[int]
    dtype: str
    sha256: str


class SchedulerState(Message, frozen=True, kw_only=True):
    """What a denoise stage needs to continue another's steps: the diffusers scheduler's class, its timesteps
    for `steps` inference steps, and how many of them are done (the next step's index)."""

    name: str
    steps: int
    timesteps: list[float]
    step_index: int = 0


class Handoff(Message, frozen=True, kw_only=True):
    """What one stage leaves for the next: tensor refs by name (`prompt_embeds`, `latents`, `generator`), the
    generation's settings (which every later stage must agree with) and the scheduler's state."""

    job_id: str
    model: str
    produced_by: StageKind
    node: str
    tensors: dict[str, TensorRef]
    seed: int
    guidance: float
    width: int
    height: int
    num_frames: int
    fps: int
    scheduler: SchedulerState


class StageJob(Message, frozen=True, kw_only=True):
    """Run one stage: the job it belongs to, the stage, and the handoff it starts from (None for encode)."""

    request_id: RequestId
    job: VideoJob
    stage: Stage
    steps: int
    handoff: Handoff | None = None


class StageDone(Message, frozen=True, kw_only=True, tag="stage_done", tag_field="t"):
    """A stage's terminal frame: the handoff for the next stage, or for decode the video itself (`video`)."""

    seq: int
    engine_id: str
    node: str
    handoff: Handoff | None = None
    video: Blob | None = None
    frames: int = 0
    usage: Usage = Usage()
    duration_s: float = 0.0


StageFrame = Union[Chunk, KeepAlive, StageDone, ErrorReply]
"""What an engine publishes to a stage job's reply inbox: progress chunks, keep-alives, then one terminal frame."""


class StageRun(Message, frozen=True, kw_only=True):
    """One stage that ran to the end, as the video job's record keeps it (its history)."""

    kind: StageKind
    start: int = 0
    end: int = 0
    node: str
    duration_s: float = 0.0


class HandoffMismatch(ValueError):
    """A handoff that does not fit the stage about to run: its settings, its step range or its tensors."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


NEEDS: dict[StageKind, dict[str, int]] = {
    "encode": {},
    "denoise": {"prompt_embeds": 3, "latents": 5, "generator": 1},
    "decode": {"latents": 5},
}
"""Tensors each stage needs from its handoff, with their number of dimensions."""


def check_handoff(handoff: Handoff | None, job: StageJob) -> None:
    """Raise HandoffMismatch unless `handoff` is what `job.stage` may start from: the same job, model and
    generation settings, the steps done so far equal to where the stage starts, and the tensors it needs with
    the right rank, a known dtype and, for latents, the shape the job's frames and size imply."""
    stage = job.stage
    if stage.kind == "encode":
        if handoff is not None:
            raise HandoffMismatch("the encode stage starts from nothing, but a handoff was given")
        return
    if handoff is None:
        raise HandoffMismatch(f"the {stage.kind} stage needs a handoff from the stage before it")
    v = job.job
    if handoff.job_id != job.request_id or handoff.model != v.model:
        raise HandoffMismatch(
            f"the handoff belongs to {handoff.job_id} ({handoff.model}), not {job.request_id} ({v.model})"
        )
    if (handoff.width, handoff.height, handoff.num_frames) != (v.width, v.height, v.num_frames):
        raise HandoffMismatch(
            f"the handoff is for {handoff.num_frames} frames of {handoff.width}x{handoff.height}, "
            f"the job asks {v.num_frames} of {v.width}x{v.height}"
        )
    if v.seed is not None and handoff.seed != v.seed:
        raise HandoffMismatch(f"the handoff was made with seed {handoff.seed}, the job has {v.seed}", param="seed")
    sched = handoff.scheduler
    if sched.steps != job.steps or len(sched.timesteps) != job.steps:
        raise HandoffMismatch(
            f"the handoff's scheduler has {len(sched.timesteps)} of {sched.steps} steps, the plan {job.steps}",
            param="steps",
        )
    want_done = stage.start if stage.kind == "denoise" else job.steps
    if sched.step_index != want_done:
        raise HandoffMismatch(
            f"the handoff has {sched.step_index} steps done; the {stage.kind} stage needs "
            f"{want_done} (steps must follow on without a gap or a repeat)"
        )
    if stage.kind == "denoise" and not 0 <= stage.start < stage.end <= job.steps:
        raise HandoffMismatch(f"denoise range {stage.start}..{stage.end} is outside 0..{job.steps}")
    for name, rank in NEEDS[stage.kind].items():
        ref = handoff.tensors.get(name)
        if ref is None:
            raise HandoffMismatch(f"the handoff lacks tensor {name!r} that the {stage.kind} stage needs")
        if len(ref.shape) != rank or any(d <= 0 for d in ref.shape):
            raise HandoffMismatch(f"tensor {name!r} has shape {ref.shape}; {rank} positive dimensions expected")
        if ref.dtype not in DTYPES:
            raise HandoffMismatch(f"tensor {name!r} has unknown dtype {ref.dtype!r}")
    latents = handoff.tensors.get("latents")
    if latents is not None and (latents.shape[0] != 1 or latents.shape[2] != v.num_frames):
        raise HandoffMismatch(f"latents {latents.shape} do not hold one video of {v.num_frames} frames")
