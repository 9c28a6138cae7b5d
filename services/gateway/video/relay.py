"""Driving a relayed video: ask the scheduler for a stage plan, run each stage on its node, keep the last handoff.

A model with `params.stages` is generated stage by stage (encode, denoise steps a..b, decode), each stage on the
node the scheduler chose by memory, its tensors handed on through the object store. After every stage the job's
record gets the new handoff, the stage history and the progress, so `GET /v1/videos/{id}` shows where the job
is. A stage that fails retryably (its node went silent or died, or its engine broke) is planned again without
that node and run again from the last stored handoff: the job never starts over from zero. A gateway taking
over a job whose gateway died (`takeover.py`) calls `run` with the record's handoff and stage history.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable

import msgspec
from coderai.contracts import (
    BusError,
    Chunk,
    ErrorReply,
    KeepAlive,
    Usage,
)
from coderai.contracts.media import Blob, VideoJob
from coderai.contracts.models import ModelConfig
from coderai.contracts.stages import (
    Handoff,
    Stage,
    StageDone,
    StageFrame,
    StageJob,
    StagePlan,
    StagePlanRequest,
    StageRun,
)
from coderai.contracts.subjects import CMD_SCHEDULER_STAGES, ENGINE_STAGE
from coderai.gateway.auth import Caller
from coderai.gateway.pipeline import Call
from coderai.gateway.state import Gateway

log = logging.getLogger("coderai.gateway")

MAX_REPLANS = 4  # stages run again elsewhere, per job, before it fails
PLAN_TIMEOUT_S = 10.0
ENCODE_SHARE, DECODE_SHARE = 5, 5  # percent of the progress bar; denoise steps share the rest

Update = Callable[..., Awaitable[None]]
"""update(**record_fields): change the job's record and save it."""


def is_staged(cfg: ModelConfig) -> bool:
    """A model opts in to stage relay with `params.stages`: true, or the number of stages its denoise is cut into."""
    return bool(cfg.params.get("stages"))


def percent(steps: int, kind: str, done_steps: int) -> int:
    """Progress of the whole job when `kind` is running with `done_steps` denoise steps done (never 100 before
    the video is stored)."""
    if kind == "encode":
        return 0
    if kind == "denoise":
        return ENCODE_SHARE + (100 - ENCODE_SHARE - DECODE_SHARE) * done_steps // max(1, steps)
    return 100 - DECODE_SHARE


def resume_at(plan: StagePlan, stage: Stage) -> int:
    """The index in `plan` of the stage that does what `stage` did (same kind and start step)."""
    for i, s in enumerate(plan.stages):
        if (s.kind, s.start) == (stage.kind, stage.start):
            return i
    raise BusError("internal", f"the new plan has no {stage.kind} stage starting at step {stage.start}")


async def _plan(gw: Gateway, job: VideoJob, exclude: list[str], headers: dict[str, str]) -> StagePlan:
    req = StagePlanRequest(job_id=job.request_id, model=job.model, steps=job.steps or 1, exclude=exclude)
    return await gw.bus.request(CMD_SCHEDULER_STAGES, req, timeout=PLAN_TIMEOUT_S, headers=headers)


async def _run_stage(
    gw: Gateway, sj: StageJob, headers: dict[str, str], on_chunk: Callable[[Chunk], Awaitable[None]]
) -> StageDone:
    """One stage on its engine: its progress chunks to `on_chunk`, its `StageDone`; a typed error is raised."""
    stream = await gw.bus.open_stream(
        ENGINE_STAGE,
        sj,
        idle_timeout_s=gw.settings.idle_timeout_s,
        headers=headers,
        node_id=sj.stage.node,
        engine_id=sj.stage.engine_id,
    )
    try:
        while True:
            frame = await stream.next(StageFrame)
            if isinstance(frame, StageDone):
                return frame
            if isinstance(frame, ErrorReply):
                raise BusError.from_reply(frame)
            if isinstance(frame, Chunk):
                await on_chunk(frame)
            elif not isinstance(frame, KeepAlive):
                raise BusError("internal", f"unexpected frame {type(frame).__name__} from a stage")
    finally:
        stream.close()


async def run(
    gw: Gateway,
    who: Caller,
    job: VideoJob,
    update: Update,
    handoff: Handoff | None = None,
    history: list[StageRun] | None = None,
) -> Blob:
    """The whole relayed job; the stored MP4 its decode stage left. `handoff` and `history`: where a job stopped
    before, to go on from."""
    call = Call(gw, who, "video", job)
    await call.admit()
    headers = call.bus_headers()
    if job.seed is None:  # every stage must draw from the same seed: fix it here, once
        job = msgspec.structs.replace(job, seed=handoff.seed if handoff else secrets.randbelow(2**31))
    if job.steps is None:
        job = msgspec.structs.replace(job, steps=call.cfg.param_int("steps", 20))
    steps = int(job.steps or 1)
    history = list(history or [])
    usage = Usage()
    excluded: list[str] = []
    try:
        await update(job=job)  # with its seed and steps fixed: a gateway taking the job over goes on with the same
        await gw.blobs.store()  # the gateway creates the object store the stages hand their tensors through
        plan = await _plan(gw, job, excluded, headers)
        i = 0
        if handoff is not None:
            done_upto = Stage(
                index=0,
                kind="decode" if handoff.scheduler.step_index >= steps else "denoise",
                start=handoff.scheduler.step_index,
                node="",
                engine_id="",
            )
            i = resume_at(plan, done_upto)
        last_write = [0.0]
        done: StageDone | None = None
        while i < len(plan.stages):
            stage: Stage = plan.stages[i]
            await update(
                status="in_progress",
                stage=stage.kind,
                node=stage.node,
                progress=percent(steps, stage.kind, stage.start),
            )

            async def on_chunk(chunk: Chunk, stage: Stage = stage) -> None:
                now = time.time()
                if chunk.progress is None or now - last_write[0] < 0.5:
                    return
                last_write[0] = now
                await update(progress=percent(steps, stage.kind, round(chunk.progress * steps)))

            sj = StageJob(request_id=job.request_id, job=job, stage=stage, steps=steps, handoff=handoff)
            t0 = time.monotonic()
            try:
                done = await _run_stage(gw, sj, headers, on_chunk)
            except BusError as exc:
                if not exc.retryable or len(excluded) >= MAX_REPLANS:
                    raise
                excluded.append(stage.node)
                log.warning(
                    "stage %s of %s on %s failed (%s); planning it elsewhere from the last handoff",
                    stage.kind,
                    job.request_id,
                    stage.node,
                    exc.message,
                )
                plan = await _plan(gw, job, excluded, headers)
                i = resume_at(plan, stage)
                continue
            history.append(
                StageRun(
                    kind=stage.kind,
                    start=stage.start,
                    end=stage.end,
                    node=done.node,
                    duration_s=round(time.monotonic() - t0, 3),
                )
            )
            usage = Usage(
                prompt_tokens=usage.prompt_tokens + done.usage.prompt_tokens,
                total_tokens=usage.total_tokens + done.usage.total_tokens,
            )
            if done.handoff is not None:
                handoff = done.handoff
            await update(handoff=handoff, stages=list(history), progress=percent(steps, stage.kind, stage.end))
            i += 1
        if done is None or done.video is None:
            raise BusError("internal", "the plan ended without a decode stage")
        video = done.video
    except BaseException as exc:
        raise await call.fail(exc) from None
    call.engine_id = done.engine_id
    await call.finish(usage=usage)
    return video
