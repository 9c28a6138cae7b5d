"""The relay driver's pure parts: the progress bar over stages, and where a re-plan goes on from."""

from __future__ import annotations

import pytest
from coderai.contracts import BusError
from coderai.contracts.stages import Stage, StagePlan
from coderai.gateway.video.relay import percent, resume_at


def plan(*stages: tuple[str, int, int, str]) -> StagePlan:
    return StagePlan(
        job_id="j",
        model="v",
        steps=8,
        stages=[
            Stage(index=i, kind=k, start=a, end=b, node=n, engine_id=f"{n}-v") for i, (k, a, b, n) in enumerate(stages)
        ],
    )


def test_progress_grows_over_stages_and_stays_below_100_until_stored():
    bar = [percent(8, "encode", 0)] + [percent(8, "denoise", k) for k in range(9)] + [percent(8, "decode", 8)]
    assert bar == sorted(bar) and bar[0] == 0 and bar[-1] == 95 and percent(8, "denoise", 8) == 95


def test_a_replan_goes_on_at_the_stage_that_failed():
    first = plan(("encode", 0, 0, "a"), ("denoise", 0, 4, "b"), ("denoise", 4, 8, "c"), ("decode", 8, 8, "a"))
    again = plan(("encode", 0, 0, "a"), ("denoise", 0, 4, "b"), ("denoise", 4, 8, "a"), ("decode", 8, 8, "b"))
    assert resume_at(again, first.stages[2]) == 2
    with pytest.raises(BusError):
        resume_at(plan(("encode", 0, 0, "a"), ("denoise", 0, 8, "b"), ("decode", 8, 8, "a")), first.stages[2])
