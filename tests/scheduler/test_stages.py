"""Stage planning is pure: encode, denoise ranges and decode go to live nodes holding the model, by memory,
spread one stage per node while nodes last; a re-plan without a dead node keeps the same stages."""

from __future__ import annotations

import itertools
import json

import pytest
from coderai.contracts import EngineStatus, Heartbeat, ModelConfig
from coderai.contracts.stages import StagePlanRequest
from coderai.sizing import MB, OVERHEAD
from coderai.scheduler.stages import (
    ModelParts,
    NoStagePlan,
    denoise_parts,
    model_parts,
    plan_stages,
    structure,
)
from coderai.testing.heartbeats import heartbeat


def hb(node: str, free_mb: int = 0, vram_free_mb: int = 0, state: str = "ready", model: str = "v") -> Heartbeat:
    eng = EngineStatus(engine_id=f"{node}-{model}", model=model, engine="video", ops=["video"], state=state)
    return heartbeat(
        node,
        ["video"],
        engines=[eng],
        mem_total=64_000 * MB,
        mem_free=free_mb * MB,
        vram_total=vram_free_mb * MB * 2,
        vram_free=vram_free_mb * MB,
    )


def cfg(stages=True) -> ModelConfig:
    return ModelConfig(name="v", engine="video", path="/nonexistent", params={"stages": stages})


PARTS = ModelParts(need={"encode": 1000 * MB, "denoise": 6000 * MB, "decode": 500 * MB}, scheduler="DDIMScheduler")


def req(steps: int = 8, exclude: list[str] | None = None) -> StagePlanRequest:
    return StagePlanRequest(job_id="j", model="v", steps=steps, exclude=exclude or [])


def where(plan) -> list[tuple[str, int, int, str]]:
    return [(s.kind, s.start, s.end, s.node) for s in plan.stages]


def test_three_nodes_get_one_stage_each_and_the_denoise_goes_where_the_unet_fits():
    nodes = {"a": hb("a", 8000), "b": hb("b", 2000), "c": hb("c", 1500)}
    p = plan_stages(req(), cfg(), nodes, PARTS)
    assert where(p) == [("encode", 0, 0, "b"), ("denoise", 0, 8, "a"), ("decode", 8, 8, "c")]
    assert [s.index for s in p.stages] == [0, 1, 2] and p.stages[1].engine_id == "a-v" and p.steps == 8


def test_a_gpu_node_offers_its_free_vram_not_its_ram():
    nodes = {"gpu": hb("gpu", free_mb=60_000, vram_free_mb=3000), "big": hb("big", 7000)}
    p = plan_stages(req(), cfg(), nodes, PARTS)
    assert {k: n for k, _, _, n in where(p)}["denoise"] == "big"  # 3 GB of VRAM cannot hold the UNet


def test_one_node_that_holds_everything_runs_every_stage():
    p = plan_stages(req(4), cfg(), {"solo": hb("solo", 9000)}, PARTS)
    assert {s.node for s in p.stages} == {"solo"} and [s.kind for s in p.stages] == ["encode", "denoise", "decode"]


def test_no_room_for_a_part_names_the_stage():
    with pytest.raises(NoStagePlan, match="denoise"):
        plan_stages(req(), cfg(), {"a": hb("a", 2000), "b": hb("b", 2000)}, PARTS)


def test_only_ready_holders_of_the_model_outside_exclude_are_candidates():
    nodes = {"a": hb("a", 9000), "b": hb("b", 9000, state="loading"), "c": hb("c", 9000, model="other")}
    assert {s.node for s in plan_stages(req(), cfg(), nodes, PARTS).stages} == {"a"}
    with pytest.raises(NoStagePlan, match="excluded: a"):
        plan_stages(req(exclude=["a"]), cfg(), nodes, PARTS)


def test_a_replan_without_the_dead_node_has_the_same_stages_elsewhere():
    nodes = {n: hb(n, 9000 - i) for i, n in enumerate("abc")}
    first = plan_stages(req(), cfg(3), nodes, PARTS)
    dead = first.stages[2].node
    again = plan_stages(req(exclude=[dead]), cfg(3), nodes, PARTS)
    assert [(s.kind, s.start, s.end) for s in again.stages] == [(s.kind, s.start, s.end) for s in first.stages]
    assert dead not in {s.node for s in again.stages}


def test_the_denoise_is_cut_only_for_a_scheduler_that_can_resume():
    nodes = {n: hb(n, 20_000) for n in "abc"}
    cut = plan_stages(req(8), cfg(3), nodes, PARTS)
    assert [(s.start, s.end) for s in cut.stages if s.kind == "denoise"] == [(0, 3), (3, 5), (5, 8)]
    whole = plan_stages(req(8), cfg(3), nodes, ModelParts(need=PARTS.need, scheduler="DPMSolverMultistepScheduler"))
    assert [(s.start, s.end) for s in whole.stages if s.kind == "denoise"] == [(0, 8)]


def test_structure_covers_every_step_once():
    for steps in (1, 2, 7, 50):
        for parts in (1, 2, 3, 9):
            ranges = [(a, b) for k, a, b in structure(steps, parts) if k == "denoise"]
            assert ranges[0][0] == 0 and ranges[-1][1] == steps
            assert all(a < b for a, b in ranges) and all(x[1] == y[0] for x, y in itertools.pairwise(ranges))
    assert denoise_parts(cfg(True)) == 1 and denoise_parts(cfg(4)) == 4


def test_part_sizes_come_from_the_component_folders(tmp_path):
    for sub, size in (("text_encoder", 3 * MB), ("tokenizer", MB), ("unet", 10 * MB), ("vae", 2 * MB)):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "weights.bin").write_bytes(b"\0" * size)
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "DDIMScheduler"}))
    parts = model_parts(str(tmp_path))
    assert parts.scheduler == "DDIMScheduler"
    assert parts.need == {
        "encode": int(4 * MB * 1.2) + OVERHEAD,
        "denoise": int(10 * MB * 1.2) + OVERHEAD,
        "decode": int(2 * MB * 1.2) + OVERHEAD,
    }
    assert model_parts(str(tmp_path / "missing")).need["denoise"] == OVERHEAD
