"""Stage handoffs are checked before a stage runs: a foreign, out-of-order or malformed handoff is a clear
HandoffMismatch, never a crash inside the model. Every stage message round-trips."""

from __future__ import annotations

import msgspec
import pytest
from coderai.contracts import decode, encode
from coderai.contracts.media import Blob, VideoJob
from coderai.contracts.stages import (
    Handoff,
    HandoffMismatch,
    SchedulerState,
    Stage,
    StageDone,
    StageFrame,
    StageJob,
    StagePlan,
    StagePlanRequest,
    TensorRef,
    check_handoff,
)
from coderai.contracts.subjects import CMD_SCHEDULER_STAGES, ENGINE_STAGE

STEPS = 4


def ref(*shape: int, dtype: str = "float32") -> TensorRef:
    return TensorRef(object="obj", shape=list(shape), dtype=dtype, sha256="0" * 64)


def video(**kw) -> VideoJob:
    return VideoJob(request_id="j", model="v", prompt="p", num_frames=4, width=64, height=64, seed=3, steps=STEPS, **kw)


def handoff(step: int = 0, **kw) -> Handoff:
    tensors = {"prompt_embeds": ref(2, 77, 32), "latents": ref(1, 4, 4, 32, 32), "generator": ref(5056, dtype="uint8")}
    fields = dict(
        job_id="j",
        model="v",
        produced_by="encode",
        node="a",
        tensors=tensors,
        seed=3,
        guidance=9.0,
        width=64,
        height=64,
        num_frames=4,
        fps=8,
        scheduler=SchedulerState(
            name="DDIMScheduler", steps=STEPS, timesteps=[751.0, 501.0, 251.0, 1.0], step_index=step
        ),
    )
    return Handoff(**{**fields, **kw})


def job(kind: str = "denoise", start: int = 0, end: int = STEPS, h: Handoff | None = None, **vkw) -> StageJob:
    return StageJob(
        request_id="j",
        job=video(**vkw),
        steps=STEPS,
        handoff=h,
        stage=Stage(index=1, kind=kind, start=start, end=end, node="b", engine_id="b-v"),
    )


def test_a_fitting_handoff_passes():
    check_handoff(None, job("encode", 0, 0))
    check_handoff(handoff(0), job())
    check_handoff(handoff(2), job(start=2))
    check_handoff(handoff(STEPS), job("decode", STEPS, STEPS))


@pytest.mark.parametrize(
    ("h", "j", "match"),
    [
        (None, job(), "needs a handoff"),
        (handoff(0), job("encode", 0, 0), "starts from nothing"),
        (handoff(0, job_id="other"), job(), "belongs to other"),
        (handoff(0, width=128), job(), "64x64"),
        (handoff(0, seed=4), job(), "seed"),
        (handoff(1), job(start=2), "1 steps done"),  # a gap
        (handoff(3), job(start=2), "3 steps done"),  # a repeat
        (handoff(2), job("decode", STEPS, STEPS), "2 steps done"),
        (handoff(0, scheduler=SchedulerState(name="DDIMScheduler", steps=8, timesteps=[1.0] * 8)), job(), "steps"),
        (handoff(0), job(start=0, end=9), "outside"),
        (handoff(0, tensors={"latents": ref(1, 4, 4, 32, 32)}), job(), "prompt_embeds"),
        (handoff(0, tensors={**handoff().tensors, "latents": ref(4, 32, 32)}), job(), "5 positive dimensions"),
        (handoff(0, tensors={**handoff().tensors, "latents": ref(1, 4, 8, 32, 32)}), job(), "4 frames"),
        (handoff(0, tensors={**handoff().tensors, "latents": ref(1, 4, 4, 32, 32, dtype="complex64")}), job(), "dtype"),
    ],
)
def test_a_mismatch_is_refused_with_a_reason(h, j, match):
    with pytest.raises(HandoffMismatch, match=match):
        check_handoff(h, j)


def test_stage_messages_round_trip_and_frames_decode_as_the_tagged_union():
    plan = StagePlan(job_id="j", model="v", steps=STEPS, stages=[job().stage])
    for msg in (plan, StagePlanRequest(job_id="j", model="v", steps=STEPS, exclude=["x"]), job(h=handoff())):
        assert decode(encode(msg), type(msg)) == msg
    done = StageDone(seq=3, engine_id="b-v", node="b", video=Blob(name="x.mp4", size=10), frames=4)
    assert decode(encode(done), StageFrame) == done
    assert ENGINE_STAGE(node_id="b", engine_id="b-v") == "coderai.engine.b.b-v.stage"
    assert CMD_SCHEDULER_STAGES.decode_reply(encode(plan)) == plan
    with pytest.raises(msgspec.ValidationError):
        decode(encode(handoff()).replace(b'"seed"', b'"sneed"'), Handoff)
