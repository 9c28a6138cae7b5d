"""Fine-tuning, worker side: the data-parallel step plan, the rendezvous address, the adapter tar; contracts."""

from __future__ import annotations

import random
from typing import Any

import pytest
from coderai.contracts import decode, encode
from coderai.contracts.subjects import CMD_NODE_TRAIN, TRAIN_REPORT, TRAIN_UPLOAD
from coderai.contracts.training import (
    AdapterAck,
    AdapterChunk,
    FileRecord,
    FineTuneCancel,
    FineTuneCreate,
    FineTuneJob,
    FineTuneReply,
    Hyperparameters,
    JobError,
    JobEvent,
    TrainReport,
    TrainSpec,
    TrainStarted,
    TrainStop,
    TrainStopped,
)
from coderai.engine_worker.trainer import plan_steps, rank_batch
from coderai.engine_worker.training import interface_of, pick_address, tar_folder

HP = Hyperparameters(n_epochs=2, batch_size=2, learning_rate_multiplier=10.0)
SPEC = TrainSpec(
    job_id="ftjob-1",
    rank=1,
    world_size=2,
    master_addr="10.0.0.1",
    master_port=2900,
    base_path="/m",
    data_store_path="finetune/ftjob-1/train.jsonl",
    adapter_store_path="finetune/ftjob-1/adapter.tar",
    valid_store_path="finetune/ftjob-1/valid.jsonl",
    method="qlora",
    hyperparameters=HP,
)
JOB = FineTuneJob(
    id="ftjob-1",
    model="m",
    training_file="file-1",
    validation_file="file-2",
    valid_loss=2.0,
    created_at=1,
    nodes=["a", "b"],
    error=JobError(code="x", message="y"),
    events=[JobEvent(id="ftevent-1-1", created_at=1, message="m", type="metrics", data={"step": 1})],
)
SAMPLES = [
    HP,
    SPEC,
    JOB,
    FineTuneReply(job=JOB),
    FineTuneCancel(job_id="ftjob-1"),
    TrainStop(job_id="ftjob-1", reason="r"),
    FileRecord(id="file-1", bytes=3, created_at=1, filename="t.jsonl", purpose="fine-tune", examples=2),
    FineTuneCreate(
        job_id="ftjob-1",
        model="m",
        training_file="file-1",
        validation_file="file-2",
        suffix="s",
        nodes=2,
        hyperparameters=HP,
    ),
    TrainStarted(node_id="a", rank=0, master_addr="10.0.0.1", master_port=2900),
    TrainStopped(node_id="a", was_running=True),
    TrainReport(
        job_id="ftjob-1",
        node_id="a",
        rank=0,
        kind="step",
        step=1,
        total_steps=4,
        loss=2.5,
        tokens_per_s=9.0,
        valid_loss=2.75,
    ),
    AdapterChunk(job_id="ftjob-1", offset=0, data=b"\x00\x01", size=2, sha256="ab"),
    AdapterAck(received=2, complete=True),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_training_messages_round_trip(msg):
    assert decode(encode(msg), type(msg)) == msg


def test_training_subjects():
    assert CMD_NODE_TRAIN(node_id="b") == "coderai.cmd.node.b.train"
    assert TRAIN_REPORT(job_id="ftjob-1", node_id="b") == "coderai.train.report.ftjob-1.b"  # a rank speaks as its node
    assert TRAIN_UPLOAD.decode_reply(encode(AdapterAck(received=1))) == AdapterAck(received=1)


def test_every_rank_runs_the_same_steps_with_full_batches():
    assert plan_steps(4, 2, 1, 3) == (2, 6)
    assert plan_steps(5, 2, 2, 1) == (2, 2)  # 3 examples a rank, 2 a batch
    assert plan_steps(1, 4, 8, 2) == (1, 2)  # fewer examples than ranks still trains
    order = [3, 0, 2, 1]
    assert rank_batch(order, 0, 0, 2, 1) == [3] and rank_batch(order, 0, 1, 2, 1) == [0]
    assert rank_batch(order, 1, 0, 2, 1) == [2] and rank_batch(order, 1, 1, 2, 1) == [1]
    assert rank_batch(order, 0, 1, 2, 2) == [0, 1]
    seen = sorted(i for s in range(2) for r in range(2) for i in rank_batch(order, s, r, 2, 1))
    assert seen == [0, 1, 2, 3]  # one epoch covers every example once
    assert rank_batch([0, 1, 2], 1, 1, 2, 1) == [0]  # wraps round


IFACES = {"lo": ["127.0.0.1"], "eth1": ["10.231.5.2"], "docker0": ["172.17.0.1"]}


def test_the_rendezvous_address_follows_setting_then_mdns_then_bus_then_interfaces():
    assert pick_address(IFACES, configured="192.168.1.9") == "192.168.1.9"
    assert pick_address(IFACES, mdns=["10.231.5.2"], bus_local="172.17.0.1") == "10.231.5.2"
    assert pick_address(IFACES, mdns=["10.9.9.9"], bus_local="172.17.0.1") == "172.17.0.1"
    assert pick_address(IFACES, bus_local="127.0.0.1") == "172.17.0.1"  # loopback never; then by interface name
    assert pick_address({"lo": ["127.0.0.1"]}) == "127.0.0.1"
    assert interface_of(IFACES, "10.231.5.2") == "eth1" and interface_of(IFACES, "1.2.3.4") == ""


async def test_the_bus_address_is_the_one_this_worker_reaches_the_bus_from(bus):
    """The bus connection's own local address (its peers reach the master there): loopback to a loopback bus."""
    from types import SimpleNamespace

    from coderai.engine_worker.training import TrainingHost

    host: Any = SimpleNamespace(bus=bus)  # only its bus is read
    assert TrainingHost._bus_local(host) == "127.0.0.1"


def test_the_adapter_tar_is_the_same_bytes_for_the_same_folder(tmp_path):
    import tarfile

    for name in ("a", "b"):
        d = tmp_path / name
        (d / "sub").mkdir(parents=True)
        (d / "adapter_config.json").write_text("{}")
        (d / "sub" / "w.bin").write_bytes(b"\x01" * 10)
    assert tar_folder(tmp_path / "a") == tar_folder(tmp_path / "b")
    out = tmp_path / "x.tar"
    out.write_bytes(tar_folder(tmp_path / "a"))
    with tarfile.open(out) as t:
        assert sorted(t.getnames()) == ["adapter_config.json", "sub/w.bin"]


def test_a_silent_trainer_exit_is_explained_without_progress_bars():
    from coderai.engine_worker.training import exit_reason

    assert (
        exit_reason(-9, ["Loading weights: 100%|##| 21/21 [00:00<00:00, 17895.24it/s]"])
        == "the trainer process was killed by SIGKILL"
    )
    tail = ["Traceback (most recent call last):", "MemoryError: out of memory", "\rLoading: 5/9 [00:01, 3it/s]"]
    assert exit_reason(1, tail) == "the trainer exited with code 1: MemoryError: out of memory"
    assert exit_reason(3, []) == "the trainer exited with code 3"


def test_the_validation_loss_is_the_mean_token_loss_without_gradients():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from coderai.engine_worker.trainer import validation_loss
    from coderai.testing.tiny_hf_llama import tiny_hf_llama
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hf_llama(), dtype=torch.float32)
    model.train()
    seqs = [[5, 9, 13, 2], [7, 8, 9, 10, 11, 12], [4]]  # the last one predicts nothing
    total, count = validation_loss(model, [(s, s) for s in seqs], torch.device("cpu"))
    assert count == 3 + 5 and model.training and all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        model.eval()
        each = [model(input_ids=torch.tensor([s]), labels=torch.tensor([s])).loss.item() for s in seqs[:2]]
    assert total / count == pytest.approx((each[0] * 3 + each[1] * 5) / 8, rel=1e-5)
    assert validation_loss(model, [], torch.device("cpu")) == (0.0, 0) and not model.training  # eval stays eval


CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass?"},
    {"role": "assistant", "content": "Green."},
]


def test_only_the_assistant_turns_are_learned_checked_by_the_gradient_on_prompt_tokens():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from coderai.engine_worker.trainer import IGNORE, encode_example
    from coderai.testing.tiny_hf_llama import tiny_hf_llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_hf_llama())
    (ids, labels), cut = encode_example(tok, CONVERSATION, 4096)
    assert not cut and len(ids) == len(labels)
    learned = tok.decode([t for t in labels if t != IGNORE])
    assert learned == "Blue.<|im_end|>\nGreen.<|im_end|>\n"  # the answers and their end, nothing of the prompt
    assert encode_example(tok, CONVERSATION, 4096, "all")[0][1] == ids  # "all": every token counts

    class Strict:  # a template that refuses to render a conversation ending on the assistant's turn
        is_fast = True

        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, *a, **kw):
            return tok(*a, **kw)

        def apply_chat_template(self, messages, **kw):
            if len(messages) < len(CONVERSATION) and messages[-1]["role"] == "assistant":
                raise ValueError("conversations must end with a user turn")
            return tok.apply_chat_template(messages, **kw)

    assert encode_example(Strict(), CONVERSATION, 4096)[0] == (ids, ids)  # the whole conversation, not a crash

    model = AutoModelForCausalLM.from_pretrained(tiny_hf_llama(), dtype=torch.float32)
    out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]))
    out.logits.retain_grad()
    out.loss.backward()
    grad = out.logits.grad[0].abs().sum(-1)  # position t predicts token t + 1
    predicts_prompt = [t for t in range(len(ids) - 1) if labels[t + 1] == IGNORE]
    predicts_answer = [t for t in range(len(ids) - 1) if labels[t + 1] != IGNORE]
    assert predicts_prompt and predicts_answer
    assert all(grad[t].item() == 0.0 for t in predicts_prompt)  # no prompt token moves the weights
    assert all(grad[t].item() > 0.0 for t in predicts_answer)


def test_a_long_example_is_cut_to_the_sequence_length_and_says_so():
    pytest.importorskip("transformers")
    from coderai.engine_worker.trainer import encode_example
    from coderai.testing.tiny_hf_llama import tiny_hf_llama
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_hf_llama())
    long = [{"role": "user", "content": "word " * 800}, {"role": "assistant", "content": "ok " * 400}]
    (ids, labels), cut = encode_example(tok, long, 1024)
    assert cut and len(ids) == len(labels) == 1024
    assert encode_example(tok, long, 100_000)[1] is False


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["bucket", "pack"])
def test_one_rank_learns_a_1024_token_conversation_and_leaves_out_one_with_nothing_left_to_learn(tmp_path, batching):
    """The trainer process itself (one rank, gloo on loopback): a 1,024-token limit, a conversation that fills
    it, one whose answer lies past it (left out, and said), and the loss on the answers going down; batched as
    examples of like lengths, or packed (the short one and the one that fills the limit share one row)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("peft")
    from coderai.contracts.training import Hyperparameters, TrainSpec
    from coderai.runtime.embedded import free_port
    from coderai.testing.tiny_hf_llama import tiny_hf_llama
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_hf_llama())
    words = "the cluster serves every model it holds " * 200
    ids = tok(words, add_special_tokens=False)["input_ids"]
    fills = tok.decode(ids[:950])  # with the template and the answer: just under 1,024 tokens
    past = tok.decode(ids[:1500])
    answer = {"role": "assistant", "content": "Seven."}
    data = tmp_path / "train.jsonl"
    data.write_text(
        "\n".join(
            json.dumps({"messages": m})
            for m in (
                [{"role": "system", "content": fills}, {"role": "user", "content": "How many?"}, answer],
                [{"role": "user", "content": past}, answer],  # its answer is cut away: nothing to learn
                [{"role": "user", "content": "How many?"}, answer],
            )
        )
    )
    spec = TrainSpec(
        job_id="ftjob-long",
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=free_port(),
        base_path=str(tiny_hf_llama()),
        data_store_path="",
        adapter_store_path="",
        hyperparameters=Hyperparameters(
            n_epochs=4, batch_size=2, learning_rate_multiplier=20, max_seq_len=1024, batching=batching
        ),
    )
    (tmp_path / "spec.json").write_bytes(encode(spec))
    r = subprocess.run(
        [sys.executable, "-m", "coderai.engine_worker.trainer", "--spec", str(tmp_path / "spec.json")]
        + ["--data", str(data), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    events = [json.loads(ln.split(" ", 1)[1]) for ln in r.stdout.splitlines() if ln.startswith("@@coderai ")]
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    started = events[0]
    assert started["event"] == "started" and started["max_seq_len"] == 1024 and started["train_on"] == "assistant"
    assert (started["examples"], started["cut_examples"], started["left_out"]) == (2, 1, 1)
    batched = next(e for e in events if e["event"] == "batching")
    assert batched["batching"] == batching and batched.get("packs") == (1 if batching == "pack" else None)
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert events[-1]["event"] == "done" and (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()


def test_bucketed_batches_hold_like_lengths_cover_every_example_and_agree_on_every_rank():
    from coderai.engine_worker.trainer import epoch_order, padding_share, plan_steps

    lengths = [random.Random(i).choice((20, 60, 300, 1000)) for i in range(200)]
    per_epoch, _ = plan_steps(len(lengths), 2, 4, 1)
    shuffled = epoch_order(lengths, 7, 0, 4, 2, bucket=False)
    bucketed = epoch_order(lengths, 7, 0, 4, 2, bucket=True)
    assert sorted(bucketed) == sorted(shuffled) == list(range(200))  # every example once an epoch
    assert bucketed == epoch_order(lengths, 7, 0, 4, 2, bucket=True)  # the same on every rank (the seed)
    assert bucketed != epoch_order(lengths, 7, 1, 4, 2, bucket=True)  # another order the next epoch
    waste = padding_share(shuffled, lengths, per_epoch, 4, 2), padding_share(bucketed, lengths, per_epoch, 4, 2)
    assert waste[0] > 0.4 and waste[1] < 0.1, waste  # 57 % -> 6 % here
    # the steps are still in random order, not shortest first
    firsts = [lengths[bucketed[s * 8]] for s in range(per_epoch)]
    assert firsts != sorted(firsts)
    assert epoch_order(lengths, 7, 0, 1, 2, bucket=True) == epoch_order(lengths, 7, 0, 1, 2, bucket=False)


def test_packs_hold_every_example_once_within_the_length_and_few_rows():
    from coderai.engine_worker.trainer import pack

    lengths = [random.Random(i).choice((20, 60, 300, 1000)) for i in range(200)]
    packs = pack(lengths, 1024)
    assert sorted(i for p in packs for i in p) == list(range(200))  # each example once
    assert all(sum(lengths[i] for i in p) <= 1024 for p in packs)
    assert packs == pack(lengths, 1024)  # the same on every rank
    fill = sum(lengths) / (len(packs) * 1024)
    assert len(packs) < 200 / 2 and fill > 0.9, (len(packs), fill)  # here 200 examples in 67 rows, 99 % full
    assert pack([1024, 1024], 1024) == [[0], [1]] and pack([], 8) == []
    assert pack([3, 5, 4, 4], 8) == [[1, 0], [2, 3]]  # best fit: the 3 joins the 5, the 4s share a row


def test_packed_rows_are_capped_where_their_mask_stays_small():
    """A job may ask any length up to the model's context; packed rows stop at 8,192 tokens, whose n x n mask is
    64 MiB a row (a tenant's 128k-token pack would want 16 GiB on the node)."""
    from coderai.engine_worker.trainer import PACK_MAX_TOKENS, sequence_length

    assert sequence_length(0, 131072, "bucket") == 131072 and sequence_length(0, 131072, "pack") == PACK_MAX_TOKENS
    assert sequence_length(1 << 20, 4096, "pack") == 4096 and sequence_length(1024, 131072, "pack") == 1024
    assert sequence_length(1 << 20, 131072, "shuffle") == 131072


def test_a_pack_gives_each_example_the_logits_and_loss_it_has_alone():
    """Packed rows are exact: a token sees only the earlier tokens of its own example (a block-diagonal mask)
    and positions start again at each example, so the pack's logits are each example's own, its loss is their
    token-weighted mean, and no example's first token is predicted from the one before it."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from coderai.engine_worker.trainer import IGNORE, _batch, encode_example, pack, packed
    from coderai.testing.tiny_hf_llama import tiny_hf_llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_hf_llama())
    model = AutoModelForCausalLM.from_pretrained(tiny_hf_llama(), dtype=torch.float32)
    model.eval()
    convs = [
        CONVERSATION,
        [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": "Seven."}],
        [{"role": "user", "content": "Say hi " * 30}, {"role": "assistant", "content": "Hi."}],
    ]
    examples = [encode_example(tok, c, 4096)[0] for c in convs]
    lengths = [len(ids) for ids, _ in examples]
    packs = pack(lengths, sum(lengths))  # all three in one row
    rows, parts = packed(examples, packs)
    assert len(rows) == 1 and parts == [[lengths[i] for i in packs[0]]]
    cpu = torch.device("cpu")
    with torch.no_grad():
        ids, mask, labels, pos, real = _batch(torch, rows + [examples[1]], 0, cpu, parts + [[lengths[1]]])
        assert mask.shape == (2, 1, ids.shape[1], ids.shape[1]) and real == sum(lengths) + lengths[1]
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
        at, total, count = 0, 0.0, 0
        for i in packs[0]:
            seq, lab = examples[i]
            alone = model(input_ids=torch.tensor([seq]), labels=torch.tensor([lab]))
            assert torch.allclose(out.logits[0, at : at + len(seq)], alone.logits[0], atol=1e-4), i
            assert labels[0, at].item() == IGNORE  # nothing before it in the row predicts its first token
            n = sum(1 for t in lab[1:] if t != IGNORE)
            total, count = total + alone.loss.item() * n, count + n
            at += len(seq)
        # the second row (one example, padded to the pack's length) is its example alone too
        alone = model(input_ids=torch.tensor([examples[1][0]]))
        assert torch.allclose(out.logits[1, : lengths[1]], alone.logits[0], atol=1e-4)
        n1 = sum(1 for t in examples[1][1][1:] if t != IGNORE)
        mean = (
            total
            + model(input_ids=torch.tensor([examples[1][0]]), labels=torch.tensor([examples[1][1]])).loss.item() * n1
        ) / (count + n1)
        assert out.loss.item() == pytest.approx(mean, rel=1e-4)
