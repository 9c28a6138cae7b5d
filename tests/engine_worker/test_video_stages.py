"""Stage relay on one machine: encode, denoise in two parts, decode, every tensor through bytes as between nodes,
gives the frames of one `pipe(...)` call with the same seed, and the engine's MP4 equals the single-node one."""

from __future__ import annotations

import pytest
from coderai.contracts import ModelConfig
from coderai.contracts.media import VideoJob
from coderai.contracts.stages import HandoffMismatch, Stage, StageJob, check_handoff
from coderai.engine_worker.engines import engine_class
from coderai.engine_worker.engines.base import CancelFlag
from coderai.tiny_models.diffusion import ensure_tiny_t2v

pytest.importorskip("diffusers")
pytestmark = pytest.mark.slow

STEPS = 4
TOLERANCE = 1e-5  # max abs difference of frames in 0..1; measured 0.0 on CPU float32 (the same ops in order)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def video_job(seed: int = 5) -> VideoJob:
    return VideoJob(
        request_id="job1", model="t2v", prompt="a cat", num_frames=4, width=64, height=64, fps=4, seed=seed, steps=STEPS
    )


def engine(stages: bool):
    params = {"threads": 1, "steps": STEPS, **({"stages": True} if stages else {})}
    e = engine_class("video")(ModelConfig(name="t2v", engine="video", path=str(ensure_tiny_t2v()), params=params))
    e.load()
    return e


def relay(e, job: VideoJob, stages: list[tuple[str, int, int]], store: dict):
    """Run the stages in order as the gateway would, each handoff's tensors through `store` (bytes by name)."""
    from coderai.engine_worker.engines.video_stages import Tensor, make_handoff

    handoff, out = None, None
    for i, (kind, a, b) in enumerate(stages):
        sj = StageJob(
            request_id=job.request_id,
            job=job,
            stage=Stage(index=i, kind=kind, start=a, end=b, node=f"n{i}", engine_id=f"n{i}-t2v"),
            steps=STEPS,
            handoff=handoff,
        )
        check_handoff(handoff, sj)
        inputs = (
            {}
            if handoff is None
            else {k: Tensor(store[r.object], r.shape, r.dtype, r.sha256) for k, r in handoff.tensors.items()}
        )
        out = e.stage(sj, inputs, CancelFlag(), lambda _i: None)
        names = {}
        for k, t in out.tensors.items():
            names[k] = f"{job.request_id}-{i}-{k}"
            store[names[k]] = t.data
        handoff = make_handoff(sj, out, f"n{i}", names)
    return out, handoff


PLAN = [("encode", 0, 0), ("denoise", 0, 2), ("denoise", 2, STEPS), ("decode", 0, 0)]


def test_stages_by_hand_equal_one_pipeline_call():
    import numpy as np
    import torch
    from coderai.engine_worker.engines.video_stages import (
        StagedVideo,
        pack_tensor,
        run_stage,
        unpack_tensor,
    )
    from diffusers import TextToVideoSDPipeline

    path = str(ensure_tiny_t2v())
    pipe = TextToVideoSDPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(
        prompt="a cat",
        num_frames=4,
        width=64,
        height=64,
        num_inference_steps=STEPS,
        guidance_scale=9.0,
        generator=torch.Generator("cpu").manual_seed(5),
        output_type="np",
    ).frames[0]
    staged = StagedVideo(path, "cpu", torch.float32)
    job = video_job()
    from coderai.engine_worker.engines.video_stages import Tensor, make_handoff

    store: dict = {}
    handoff, steps_seen = None, []
    for i, (kind, a, b) in enumerate(PLAN):
        sj = StageJob(
            request_id="job1",
            job=job,
            stage=Stage(index=i, kind=kind, start=a, end=b, node="n", engine_id="e"),
            steps=STEPS,
            handoff=handoff,
        )
        check_handoff(handoff, sj)
        inputs = (
            {}
            if handoff is None
            else {k: Tensor(store[r.object], r.shape, r.dtype, r.sha256) for k, r in handoff.tensors.items()}
        )
        out = run_stage(staged, sj, inputs, 9.0, 5, CancelFlag(), steps_seen.append)
        store.update({f"{i}{k}": t.data for k, t in out.tensors.items()})
        handoff = make_handoff(sj, out, "n", {k: f"{i}{k}" for k in out.tensors})
    assert steps_seen == list(range(STEPS))
    assert staged.loaded() == ["decode", "denoise", "encode"]
    assert out.frames.shape == ref.shape == (4, 64, 64, 3)
    assert np.abs(out.frames - ref).max() <= TOLERANCE
    # bfloat16 and friends travel as bytes too
    t = torch.randn(2, 3).to(torch.bfloat16)
    p = pack_tensor(t)
    assert torch.equal(unpack_tensor("t", p.data, p.shape, p.dtype, p.sha256), t)


def test_engine_relay_mp4_equals_the_single_node_mp4():
    single, staged = engine(False), engine(True)
    try:
        assert staged.pipe is None  # nothing loaded until a stage needs its part
        whole, _ = single.video(video_job(seed=9), CancelFlag(), None)
        out, handoff = relay(staged, video_job(seed=9), [("encode", 0, 0), ("denoise", 0, STEPS), ("decode", 0, 0)], {})
        assert out.frames == whole.video.data  # the frames were equal to the bit, so the MP4s are too
        assert handoff.scheduler.step_index == STEPS and handoff.seed == 9
    finally:
        single.close()
        staged.close()


def test_a_corrupted_or_foreign_handoff_is_refused_with_a_clear_error():
    e = engine(True)
    try:
        store: dict = {}
        _, handoff = relay(e, video_job(), PLAN[:2], store)
        nxt = StageJob(
            request_id="job1",
            job=video_job(),
            stage=Stage(index=2, kind="denoise", start=2, end=STEPS, node="n", engine_id="e"),
            steps=STEPS,
            handoff=handoff,
        )
        check_handoff(handoff, nxt)
        from coderai.engine_worker.engines.video_stages import Tensor

        name = handoff.tensors["latents"].object
        store[name] = bytes(len(store[name]))  # zeroed in the store
        inputs = {k: Tensor(store[r.object], r.shape, r.dtype, r.sha256) for k, r in handoff.tensors.items()}
        with pytest.raises(HandoffMismatch, match="checksum"):
            e.stage(nxt, inputs, CancelFlag(), lambda _i: None)
        with pytest.raises(HandoffMismatch, match="seed"):
            check_handoff(
                handoff,
                StageJob(request_id="job1", job=video_job(seed=6), stage=nxt.stage, steps=STEPS, handoff=handoff),
            )
    finally:
        e.close()
