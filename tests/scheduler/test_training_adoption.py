"""Fine-tuning across a scheduler restart, the pure parts: which job records a new scheduler adopts, restarts,
fails or leaves, the live state it rebuilds from a record, and which of a rank's kept reports it replays."""

from __future__ import annotations

import pytest
from coderai.contracts import ModelConfig, decode, encode
from coderai.contracts.subjects import CMD_NODE_TRAIN_STATE
from coderai.contracts.training import FineTuneJob, TrainReport, TrainState, TrainStateAsk
from coderai.scheduler import training_plan as tp

BASE = ModelConfig(name="tiny", engine="transformers", path="/m/tiny", params={"max_tokens": 8})
OTHER = ModelConfig(name="other", engine="llama", path="/m/o.gguf")


def job(
    status: str, suffix: str = "ft1", nodes: tuple[str, ...] = ("head", "node-b"), model: str = "tiny"
) -> FineTuneJob:
    return FineTuneJob(
        id="ftjob-abc",
        model=model,
        training_file="file-1",
        suffix=suffix,
        status=status,
        created_at=1,
        nodes=list(nodes),
    )


def step(n: int, node: str = "head", rank: int = 0, job_id: str = "ftjob-abc") -> TrainReport:
    return TrainReport(
        job_id=job_id,
        node_id=node,
        rank=rank,
        kind="step",
        step=n,
        total_steps=9,
        loss=1.0,
        tokens_per_s=5.0,
        trained_tokens=10 * n,
    )


def recorded(j: FineTuneJob, *steps: int) -> FineTuneJob:
    for n in steps:
        said, data = tp.step_event(n, 9, 1.0, 5.0, 10 * n, None)
        j = tp.add_event(j, said, type_="metrics", data=data)
    return tp.add_event(j, "a message event")


@pytest.mark.parametrize("status", ["succeeded", "failed", "cancelled"])
def test_terminal_jobs_are_left_alone(status):
    assert tp.adoption(job(status), [BASE]).action == "leave"


def test_a_running_job_is_adopted_with_the_name_it_was_created_for():
    plan = tp.adoption(job("running"), [OTHER, BASE])
    assert plan.action == "adopt" and plan.base == BASE and plan.name == "tiny:ft1-abc"
    assert tp.adoption(job("running", suffix=""), [BASE]).name == "tiny:ftjob-abc"  # no suffix: the job id


@pytest.mark.parametrize("status", ["validating_files", "queued"])
def test_a_job_caught_before_its_ranks_ran_is_started_again(status):
    plan = tp.adoption(job(status), [BASE])
    assert plan.action == "restart" and plan.base == BASE and plan.name == "tiny:ft1-abc"


def test_a_job_whose_base_model_is_gone_fails_saying_so():
    plan = tp.adoption(job("running", model="gone"), [BASE])
    assert plan.action == "fail" and "'gone'" in plan.message and "restarted" in plan.message
    assert tp.adoption(job("queued", nodes=()), [BASE]).action == "fail"


def test_the_ranks_are_rebuilt_from_the_record_with_a_fresh_grace_period():
    ranks = tp.ranks_of(job("running").nodes, 500.0)
    assert [(r.rank, r.node_id, r.last_seen, r.done, r.failed) for r in ranks] == [
        (0, "head", 500.0, False, ""),
        (1, "node-b", 500.0, False, ""),
    ]
    assert tp.verdict(ranks, 500.0 + tp.SILENT_S) == ""  # not silent until the grace period is over
    assert tp.verdict(ranks, 500.0 + tp.SILENT_S + 1).startswith("rank 0 on node head stopped reporting")


def test_the_steps_of_the_gap_and_the_final_report_are_replayed_once():
    j = recorded(job("running"), 1, 2, 3)
    assert tp.last_step(j) == 3 and tp.last_step(job("running")) == 0
    done = TrainReport(job_id=j.id, node_id="head", rank=0, kind="done", digest="d" * 64)
    state = TrainState(
        node_id="head", rank=0, known=True, running=False, reports=[step(2), step(3), step(4), step(5), done]
    )
    got = tp.missed(j, tp.Rank(0, "head", 0.0), state)
    assert [(r.kind, r.step) for r in got] == [("step", 4), ("step", 5), ("done", 0)]


def test_a_rank_still_running_hands_over_its_steps_and_nothing_else():
    state = TrainState(node_id="head", rank=0, known=True, running=True, reports=[step(1), step(2)])
    assert [r.step for r in tp.missed(job("running"), tp.Rank(0, "head", 0.0), state)] == [1, 2]
    assert (
        tp.missed(
            job("running"), tp.Rank(1, "node-b", 0.0), TrainState(node_id="node-b", rank=1, known=True, running=True)
        )
        == []
    )


def test_a_rank_that_failed_in_the_gap_or_was_forgotten_fails_the_job_naming_it():
    r1 = tp.Rank(1, "node-b", 0.0)
    failed = TrainReport(
        job_id="ftjob-abc", node_id="node-b", rank=1, kind="failed", message="the trainer process was killed by SIGKILL"
    )
    got = tp.missed(job("running"), r1, TrainState(node_id="node-b", rank=1, known=True, reports=[failed]))
    assert got == [failed]
    forgot = tp.missed(job("running"), r1, TrainState(node_id="node-b"))
    assert [(r.kind, r.rank, r.node_id) for r in forgot] == [("failed", 1, "node-b")]
    assert "no longer runs the job" in forgot[0].message
    r1.failed, r1.failed_at = forgot[0].message, 1.0
    assert tp.verdict([tp.Rank(0, "head", 1.0), r1], 1.5).startswith("rank 1 on node node-b failed: its worker")
    stopped = tp.missed(job("running"), r1, TrainState(node_id="node-b", rank=1, known=True, running=False))
    assert [r.kind for r in stopped] == ["failed"] and "stopped" in stopped[0].message


def test_reports_of_another_rank_or_job_are_not_replayed():
    state = TrainState(
        node_id="head",
        rank=0,
        known=True,
        running=True,
        reports=[step(1, job_id="ftjob-other"), step(2, node="node-b"), step(3)],
    )
    assert [r.step for r in tp.missed(job("running"), tp.Rank(0, "head", 0.0), state)] == [3]


def test_the_state_request_round_trips_on_its_node_scoped_subject():
    assert CMD_NODE_TRAIN_STATE(node_id="node-b") == "coderai.cmd.node.node-b.train_state"
    state = TrainState(node_id="b", rank=1, known=True, running=True, reports=[step(1)])
    assert CMD_NODE_TRAIN_STATE.decode_reply(encode(state)) == state
    assert decode(encode(TrainStateAsk(job_id="ftjob-1")), TrainStateAsk) == TrainStateAsk(job_id="ftjob-1")
