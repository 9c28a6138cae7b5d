"""Fine-tuning API, pure parts: training files checked with line numbers, job requests resolved, OpenAI shapes."""

from __future__ import annotations

import json

import msgspec
import pytest
from coderai.contracts.training import FineTuneJob, JobError
from coderai.gateway.errors import ApiError
from coderai.gateway.openai.fine_tuning import JobRequest, events_page, job_json, resolve
from coderai.scheduler.training_plan import add_event
from coderai.training_data import BadTrainingFile, parse_examples

GOOD = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ]
}


def lines(*objs) -> bytes:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs).encode()


def test_a_good_file_parses_and_blank_lines_are_skipped():
    ex = parse_examples(lines(GOOD, "", GOOD))
    assert len(ex) == 2 and ex[0][2] == {"role": "assistant", "content": "Hello."}


@pytest.mark.parametrize(
    "data, line, words",
    [
        (lines(GOOD, "this is not json"), 2, "not valid JSON"),
        (
            lines(GOOD, GOOD, {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}),
            3,
            "role 'robot'",
        ),
        (lines({"prompt": "old style", "completion": "x"}), 1, '"messages"'),
        (lines({"messages": [{"role": "user", "content": "only a question"}]}), 1, "no assistant message"),
        (
            lines({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]}),
            1,
            'string "content"',
        ),
        (lines({"messages": []}), 1, "non-empty list"),
        (lines(["a", "list"]), 1, "JSON object"),
        (b'{"messages": []}\n\xff\xfe\n', 2, "UTF-8"),
    ],
)
def test_bad_files_name_the_line(data, line, words):
    with pytest.raises(BadTrainingFile) as exc:
        parse_examples(data)
    assert exc.value.line == line and str(exc.value).startswith(f"line {line}: ") and words in str(exc.value)


@pytest.mark.parametrize("data", [b"", b"\n\n  \n"])
def test_an_empty_file_is_refused(data):
    with pytest.raises(BadTrainingFile, match="empty"):
        parse_examples(data)


def req(**kw) -> JobRequest:
    return msgspec.json.decode(json.dumps({"model": "tiny", "training_file": "file-1", **kw}), type=JobRequest)


def test_defaults_and_auto_resolve():
    c = resolve(req(hyperparameters={"n_epochs": "auto"}), "ftjob-1", "k")
    assert (c.method, c.nodes, c.lora_rank, c.lora_alpha, c.key_name) == ("lora", 0, 8, 16, "k")
    assert (c.hyperparameters.n_epochs, c.hyperparameters.batch_size, c.hyperparameters.learning_rate_multiplier) == (
        3,
        1,
        1.0,
    )


def test_coderai_extensions_and_openai_method_object():
    c = resolve(
        req(
            method="qlora",
            nodes=2,
            lora_rank=4,
            lora_alpha=8,
            suffix="s",
            seed=3,
            hyperparameters={"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 10},
        ),
        "ftjob-1",
    )
    assert (c.method, c.nodes, c.lora_rank, c.lora_alpha, c.suffix, c.seed) == ("qlora", 2, 4, 8, "s", 3)
    assert c.hyperparameters.learning_rate_multiplier == 10.0
    c = resolve(req(method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 5}}}), "ftjob-1")
    assert c.method == "lora" and c.hyperparameters.n_epochs == 5


def test_sequence_length_and_what_the_loss_counts_are_hyperparameters():
    c = resolve(req(), "ftjob-1")
    assert (c.hyperparameters.max_seq_len, c.hyperparameters.train_on) == (0, "assistant")  # the model's context
    c = resolve(req(hyperparameters={"max_seq_len": 1024, "train_on": "all"}), "ftjob-1")
    assert (c.hyperparameters.max_seq_len, c.hyperparameters.train_on) == (1024, "all")
    assert c.hyperparameters.batching == "bucket"  # batches of like lengths unless asked
    assert resolve(req(hyperparameters={"batching": "shuffle"}), "ftjob-1").hyperparameters.batching == "shuffle"
    assert resolve(req(hyperparameters={"batching": "pack"}), "ftjob-1").hyperparameters.batching == "pack"


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"method": "full"}, "method"),
        ({"method": {"type": "dpo"}}, "method"),
        ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
        ({"hyperparameters": {"batch_size": 1.5}}, "hyperparameters.batch_size"),
        ({"hyperparameters": {"learning_rate_multiplier": "fast"}}, "hyperparameters.learning_rate_multiplier"),
        ({"hyperparameters": {"warmup": 3}}, "hyperparameters"),
        ({"hyperparameters": {"max_seq_len": -1}}, "hyperparameters.max_seq_len"),
        ({"hyperparameters": {"train_on": "user"}}, "hyperparameters.train_on"),
        ({"hyperparameters": {"batching": "packed"}}, "hyperparameters.batching"),
        ({"hyperparameters": {"batching": ["pack"]}}, "hyperparameters.batching"),
        ({"lora_rank": 0}, "lora_rank"),
        ({"nodes": -1}, "nodes"),
        ({"method": {"type": "supervised", "supervised": "x"}}, "method.supervised"),
        ({"method": {"type": "lora", "lora": {"hyperparameters": [1]}}}, "method.lora.hyperparameters"),
    ],
)
def test_bad_requests_are_400_naming_the_field(kw, param):
    with pytest.raises(ApiError) as exc:
        resolve(req(**kw), "ftjob-1")
    assert exc.value.status == 400 and exc.value.param == param


def test_a_validation_file_goes_to_the_scheduler_and_shows_in_the_job():
    assert resolve(req(validation_file="file-2"), "ftjob-1").validation_file == "file-2"
    assert resolve(req(), "ftjob-1").validation_file is None
    assert resolve(req(validation_file=""), "ftjob-1").validation_file is None
    job = FineTuneJob(
        id="ftjob-v", model="tiny", training_file="file-1", validation_file="file-2", created_at=5, valid_loss=1.25
    )
    j = job_json(job)
    assert j["validation_file"] == "file-2" and j["training_file"] == "file-1" and j["coderai"]["valid_loss"] == 1.25
    plain = job_json(FineTuneJob(id="ftjob-p", model="tiny", training_file="file-1", created_at=5))
    assert plain["validation_file"] is None and plain["coderai"]["valid_loss"] is None


def test_job_and_events_are_openai_shaped():
    job = FineTuneJob(
        id="ftjob-abc",
        model="tiny",
        training_file="file-1",
        suffix="s",
        created_at=5,
        status="failed",
        nodes=["a", "b"],
        error=JobError(code="rank_failed", message="rank 1 on node b failed"),
    )
    for i in range(5):
        job = add_event(job, f"Step {i}", type_="metrics", data={"step": i}, now=10.0 + i)
    j = job_json(job)
    assert j["object"] == "fine_tuning.job" and j["status"] == "failed" and j["user_provided_suffix"] == "s"
    assert j["error"] == {"code": "rank_failed", "message": "rank 1 on node b failed", "param": None}
    assert j["coderai"]["nodes"] == ["a", "b"] and j["hyperparameters"]["n_epochs"] == 3
    page = events_page(job, None, 2)
    assert page["object"] == "list" and page["has_more"] is True
    assert [e["message"] for e in page["data"]] == ["Step 4", "Step 3"]  # newest first
    assert page["data"][0]["object"] == "fine_tuning.job.event" and page["data"][0]["data"] == {"step": 4}
    rest = events_page(job, page["data"][-1]["id"], 10)
    assert [e["message"] for e in rest["data"]] == ["Step 2", "Step 1", "Step 0"] and rest["has_more"] is False
