"""Fine-tuning, scheduler side: node choice and rank order, blame when a job breaks, events, the served config."""

from __future__ import annotations

import pytest
from coderai.contracts import BusError, Heartbeat, ModelConfig
from coderai.contracts.training import MAX_EVENTS, FileRecord, FineTuneJob
from coderai.scheduler import training_plan as tp

BASE = ModelConfig(name="tiny", engine="transformers", path="/m/tiny", params={"max_tokens": 8}, nodes=["a"])


def hb(node: str, caps: list[str], pod: str = "") -> Heartbeat:
    return Heartbeat(node_id=node, version="0", seq=1, ts=0.0, host=node, capabilities=caps, pod=pod)


NODES = {
    "a": hb("a", ["llama", "transformers", "train"]),
    "b": hb("b", ["transformers", "train", "qlora"]),
    "c": hb("c", ["llama"]),  # no finetune extra
    "p": hb("p", ["transformers", "train"], pod="pod-1"),  # a rented pod brings its own models
}


def test_only_owned_nodes_with_the_train_capability_are_eligible():
    assert tp.eligible_nodes(NODES, BASE, "lora") == ["a", "b"]


def test_qlora_needs_a_node_with_bitsandbytes():
    assert tp.eligible_nodes(NODES, BASE, "qlora") == ["b"]
    with pytest.raises(BusError) as exc:
        tp.eligible_nodes({"a": NODES["a"]}, BASE, "qlora")
    assert exc.value.code == "bad_request" and exc.value.param == "method"
    assert "bitsandbytes" in exc.value.message and "CUDA" in exc.value.message and "a" in exc.value.message


def test_no_trainer_at_all_is_no_engine():
    with pytest.raises(BusError) as exc:
        tp.eligible_nodes({"c": NODES["c"]}, BASE, "lora")
    assert exc.value.code == "no_engine" and "finetune" in exc.value.message


def test_ranks_put_holders_of_the_base_model_first_then_by_id():
    assert tp.choose_ranks(["a", "b", "c"], 0, {"c"}) == ["c", "a", "b"]
    assert tp.choose_ranks(["a", "b", "c"], 2) == ["a", "b"]
    with pytest.raises(BusError) as exc:
        tp.choose_ranks(["a", "b"], 3)
    assert exc.value.param == "nodes" and "only 2" in exc.value.message


def test_a_rank_that_failed_by_itself_is_blamed_at_once():
    ranks = [
        tp.Rank(0, "a", last_seen=100.0, failed="lost a peer", peer=True, failed_at=100.0),
        tp.Rank(1, "b", last_seen=100.0, failed="the trainer exited with signal 9", failed_at=100.0),
    ]
    assert tp.verdict(ranks, 100.5) == "rank 1 on node b failed: the trainer exited with signal 9"


def test_a_silent_rank_is_blamed_before_the_rank_that_lost_it():
    ranks = [
        tp.Rank(0, "a", last_seen=120.0, failed="lost a peer rank: connection closed", peer=True, failed_at=101.0),
        tp.Rank(1, "b", last_seen=100.0),
    ]
    assert tp.verdict(ranks, 105.0) == ""  # b is not silent long enough yet, a's peer failure waits for it
    why = tp.verdict(ranks, 100.0 + tp.SILENT_S + 1)
    assert why.startswith("rank 1 on node b stopped reporting")


def test_a_peer_failure_alone_is_blamed_after_the_grace():
    ranks = [
        tp.Rank(0, "a", last_seen=200.0, failed="lost a peer rank", peer=True, failed_at=100.0),
        tp.Rank(1, "b", last_seen=200.0, done=True, digest="x"),
    ]
    assert tp.verdict(ranks, 100.0 + tp.PEER_GRACE_S - 1) == ""
    assert tp.verdict(ranks, 100.0 + tp.PEER_GRACE_S + 1) == "rank 0 on node a failed: lost a peer rank"


def test_a_job_finishes_only_when_every_rank_has_the_same_adapter():
    a, b = tp.Rank(0, "a", 0.0, digest="d1", done=True), tp.Rank(1, "b", 0.0)
    assert tp.finished([a, b]) is None
    b.done, b.digest = True, "d1"
    assert tp.finished([a, b]) == ""
    b.digest = "d2"
    assert "different adapters" in tp.finished([a, b])


def test_events_count_up_and_are_capped():
    job = FineTuneJob(id="ftjob-abc", model="tiny", training_file="file-x", created_at=1)
    for i in range(MAX_EVENTS + 5):
        job = tp.add_event(job, f"e{i}", now=float(i))
    assert len(job.events) == MAX_EVENTS
    assert job.events[-1].id == f"ftevent-abc-{MAX_EVENTS + 5}" and job.events[-1].message == f"e{MAX_EVENTS + 4}"
    assert job.events[0].message == "e5"


def test_the_served_model_is_the_base_config_with_the_adapter():
    cfg = tp.finetuned_config(
        BASE, "tiny:mine", "/store/finetune/j/adapter.tar", "finetune/j/adapter.tar", 7, base_bytes=100 << 20
    )
    assert cfg.name == "tiny:mine" and cfg.engine == "transformers" and cfg.nodes == ["a"]
    assert cfg.path == "/store/finetune/j/adapter.tar" and cfg.store_path == "finetune/j/adapter.tar"
    assert cfg.params == {"max_tokens": 8, "base": "/m/tiny"} and cfg.created == 7
    assert cfg.memory_mb == 120 + 256


def test_names_and_suffixes():
    assert tp.finetuned_name("tiny", "mine", "ftjob-0123456789ab") == "tiny:mine-01234567"
    assert tp.finetuned_name("tiny", "", "ftjob-1") == "tiny:ftjob-1"
    # two keys choosing one suffix get a name each: no key learns of another's model by its suffix being taken
    assert tp.finetuned_name("tiny", "mine", "ftjob-aaaaaaaa") != tp.finetuned_name("tiny", "mine", "ftjob-bbbbbbbb")
    tp.check_suffix("ok_suffix-1")
    with pytest.raises(BusError) as exc:
        tp.check_suffix("no spaces")
    assert exc.value.param == "suffix"


@pytest.mark.parametrize("param", ["training_file", "validation_file"])
def test_a_job_file_must_be_an_uploaded_fine_tune_file_and_the_error_names_its_field(param):
    rec = FileRecord(id="file-1", bytes=3, created_at=1, filename="t.jsonl", purpose="fine-tune")
    assert tp.check_file(rec, "file-1", param) is rec
    with pytest.raises(BusError) as exc:
        tp.check_file(None, "file-nope", param)
    assert (exc.value.code, exc.value.param) == ("bad_request", param) and "file-nope" in exc.value.message
    with pytest.raises(BusError) as exc:
        tp.check_file(
            FileRecord(id="file-2", bytes=3, created_at=1, filename="a", purpose="assistants"), "file-2", param
        )
    assert (exc.value.code, exc.value.param) == ("bad_request", param) and "'assistants'" in exc.value.message


def test_step_events_carry_the_validation_loss_only_when_there_is_one():
    said, data = tp.step_event(3, 6, 2.5, 850.0, 120, None)
    assert said == "Step 3/6: training loss=2.5000, 850 tokens/s"
    assert data == {"step": 3, "total_steps": 6, "train_loss": 2.5, "tokens_per_s": 850.0, "trained_tokens": 120}
    said, data = tp.step_event(6, 6, 2.0, 850.0, 240, 2.25)
    assert said == "Step 6/6: training loss=2.0000, validation loss=2.2500, 850 tokens/s"
    assert data["valid_loss"] == data["full_valid_loss"] == 2.25 and data["train_loss"] == 2.0


def test_a_vllm_model_can_be_fine_tuned_and_its_adapter_is_served_by_vllm():
    vllm_base = ModelConfig(name="tiny", engine="vllm", path="/m/tiny", params={"dtype": "bfloat16"})
    tp.check_base(vllm_base)
    cfg = tp.finetuned_config(vllm_base, "tiny:mine", "/store/ft.tar", "finetune/j/adapter.tar", 1)
    assert (cfg.engine, cfg.path, cfg.params) == ("vllm", "/store/ft.tar", {"dtype": "bfloat16", "base": "/m/tiny"})
    with pytest.raises(BusError) as exc:
        tp.check_base(ModelConfig(name="e", engine="echo", path=""))
    assert exc.value.param == "model" and '"transformers" or "vllm" or "llama-server"' in exc.value.message


def test_a_gguf_model_is_trained_on_the_folder_it_was_made_from_and_served_by_llama_server_with_the_adapter():
    with pytest.raises(BusError) as exc:
        tp.check_base(ModelConfig(name="g", engine="llama-server", path="/m/g.gguf"))
    assert exc.value.param == "model" and "params.hf_path" in exc.value.message
    gguf = ModelConfig(name="g", engine="llama-server", path="/m/g.gguf", params={"hf_path": "/m/g-hf", "parallel": 2})
    tp.check_base(gguf)
    assert tp.train_path(gguf) == "/m/g-hf" and tp.train_path(BASE) == "/m/tiny"
    cfg = tp.finetuned_config(gguf, "g:mine", "/store/ft.tar", "finetune/j/adapter.tar", 1)
    assert (cfg.engine, cfg.path) == ("llama-server", "/store/ft.tar")
    assert cfg.params == {"hf_path": "/m/g-hf", "parallel": 2, "base": "/m/g.gguf"}
