"""One engine's side of stage relay: answer `coderai.engine.<id>.stage` jobs for a relayed video.

The job names a handoff whose tensors lie in the `coderai_blobs` object store (which chunks them itself; no
tensor ever rides in a message). The handoff is checked before anything runs; the stage runs in the engine's
own thread (one job at a time, as every other op of this engine); its tensors go back to the object store and
the terminal `StageDone` frame carries the new handoff. While it runs the caller gets a progress chunk per
denoise step and keep-alives, so a stage whose node dies is told from a slow one and run again elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from coderai.contracts import Chunk, ErrorReply, Usage
from coderai.contracts.media import Blob
from coderai.contracts.stages import HandoffMismatch, StageDone, StageJob, check_handoff
from coderai.contracts.subjects import ENGINE_STAGE
from coderai.engine_worker.engines.base import CancelFlag
from coderai.runtime.blobs import BlobMissing
from coderai.runtime.bus import DONE, FrameWriter, pump
from coderai.runtime.logging import request_id_var

log = logging.getLogger("coderai.engine_worker")


def serves_stages(host: Any) -> bool:
    """Whether the host's engine runs relay stages (a video model with `params.stages`)."""
    return getattr(host.engine, "staged", None) is not None


async def subscribe(host: Any) -> Any:
    """The stage subscription of `host`'s engine: each stage runs as a task of the host (no queue limit)."""
    return await host.bus.serve_stream(
        ENGINE_STAGE,
        lambda job, writer, _m: run(host, job, writer),
        spawn=host.spawn,
        subject_str=ENGINE_STAGE(node_id=host.node_id, engine_id=host.engine_id),
    )


async def _inputs(host: Any, job: StageJob) -> dict[str, Any]:
    from coderai.engine_worker.engines.video_stages import Tensor

    out = {}
    for name, ref in job.handoff.tensors.items() if job.handoff else ():
        data = await host.blobs.get(Blob(name=ref.object))
        out[name] = Tensor(data=data, shape=ref.shape, dtype=ref.dtype, sha256=ref.sha256)
    return out


async def run(host: Any, job: StageJob, writer: FrameWriter) -> None:
    """Run one stage and answer it: progress chunks, keep-alives, then `StageDone` or a typed error."""
    from coderai.engine_worker.engines.video_stages import make_handoff

    request_id_var.set(job.request_id)
    stage = job.stage
    what = f"{stage.kind} {stage.start}..{stage.end}" if stage.kind == "denoise" else stage.kind
    flag = host._cancels[job.request_id] = CancelFlag()
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    host.in_flight += 1
    t0 = time.monotonic()
    log.info("stage %s of %s started", what, job.request_id)
    try:
        check_handoff(job.handoff, job)
        inputs = await _inputs(host, job)

        def on_step(i: int) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, i)

        fut = loop.run_in_executor(host._executor, host.engine.stage, job, inputs, flag, on_step)
        fut.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, DONE))

        async def step_done(item: int) -> None:
            log.info("stage %s of %s: step %d/%d done", what, job.request_id, item + 1, job.steps)
            await writer.send(Chunk(seq=writer.next_seq(), progress=(item + 1) / job.steps))

        await pump(queue, writer, host.keepalive_s, step_done)
        out = fut.result()
        objects = {}
        for name, t in out.tensors.items():
            objects[name] = (await host.blobs.put(t.data, "application/octet-stream")).name
        handoff = make_handoff(job, out, host.node_id, objects) if out.frames is None else None
        video = None
        if out.frames is not None:
            video = await host.blobs.put(out.frames, "video/mp4", suffix=".mp4")
        usage = Usage(prompt_tokens=out.tokens, total_tokens=out.tokens)
        done = StageDone(
            seq=writer.next_seq(),
            engine_id=host.engine_id,
            node=host.node_id,
            handoff=handoff,
            video=video,
            frames=job.job.num_frames if video else 0,
            usage=usage,
            duration_s=time.monotonic() - t0,
        )
        await writer.send(done)
        host.served += 1
        log.info("stage %s of %s done in %.2fs", what, job.request_id, done.duration_s)
    except (HandoffMismatch, BlobMissing, ValueError) as exc:  # a handoff that does not fit, or a bad job
        log.warning("stage %s of %s refused: %s", what, job.request_id, exc)
        await writer.send(
            ErrorReply(
                code="bad_request",
                message=f"stage {what}: {exc}",
                seq=writer.next_seq(),
                param=getattr(exc, "param", None),
            )
        )
    except Exception as exc:
        log.exception("stage %s of %s failed", what, job.request_id)
        await writer.send(
            ErrorReply(
                code="engine_failed",
                message=f"stage {what}: {type(exc).__name__}: {exc}",
                retryable=True,
                seq=writer.next_seq(),
            )
        )
    finally:
        host.in_flight -= 1
        host._cancels.pop(job.request_id, None)
