"""`python -m coderai.engine_worker.trainer --spec S --data D [--valid V] --out O`: one rank of a fine-tuning job.

It runs in a child process of the worker (torch and its threads stay out of the worker's event loop, and a crash
here never takes the worker's engines down) and dies with its parent. Ranks meet at the master address the
scheduler handed out (`MASTER_ADDR`/`MASTER_PORT`; `GLOO_SOCKET_IFNAME`/`NCCL_SOCKET_IFNAME` name the interface
towards it) and train synchronously data-parallel: every rank takes its share of each batch, the LoRA gradients
are averaged with all_reduce, and every rank applies the same AdamW step to the same start (broadcast from rank
0), so all ranks end with identical adapters. With a validation file, every rank computes the loss of its strided
share of the validation examples (no gradient) at the end of each epoch, and one all_reduce makes it the mean
token loss over the whole file; the epoch's last step event carries it. Progress goes to stdout as `@@coderai {json}` lines the worker
forwards over the bus.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import os
import random
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

from coderai.contracts import decode
from coderai.contracts.training import BASE_LEARNING_RATE, TrainSpec
from coderai.engine_worker.engines.base import to_device
from coderai.training_data import parse_examples

MARK = "@@coderai "
COLLECTIVE_TIMEOUT_S = 300.0  # a rank that is gone is noticed sooner: its socket closes, or the scheduler sees silence


BNB_CPU_SINCE = (0, 47)  # bitsandbytes quantizes and computes 4-bit layers on the CPU from this version on


def qlora_backend(cuda: bool) -> str:
    """Where QLoRA would run here ("cuda", "cpu"), or why it cannot: bitsandbytes must be installed, and without
    a CUDA GPU be one whose CPU backend runs 4-bit layers. Reads the installed version only (no import)."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return ""
    if cuda:
        return "cuda"
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    return "cpu" if parts >= BNB_CPU_SINCE else ""


class PeerFailed(RuntimeError):
    """A collective failed: another rank went away (or never came)."""


def say(**fields) -> None:
    print(MARK + json.dumps(fields), flush=True)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the worker that started it dies, so no rank outlives its node."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        sys.exit(1)


def _collective(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except Exception as exc:  # gloo/nccl raise several types for a lost peer
        raise PeerFailed(f"{type(exc).__name__}: {exc}") from exc


def adapter_digest(model) -> str:
    """sha256 over the trainable (LoRA) tensors by name: equal on ranks that hold equal adapters."""
    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.requires_grad:
            h.update(name.encode())
            h.update(p.detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


Example = tuple[list[int], list[int]]
"""(token ids, labels): a label is the id where the loss counts, IGNORE where it does not"""
IGNORE = -100  # what transformers' loss skips


def encode_example(tok, messages: list[dict], max_len: int, train_on: str = "assistant") -> tuple[Example, bool]:
    """One conversation as the model sees it (its chat template) and the tokens it learns: with `train_on`
    "assistant", only the assistant turns' own tokens (what the template adds after each, such as its end
    token, included) count in the loss, never the system or user text nor the template's role headers; with
    "all", every token. Cut to `max_len` tokens; the second value says whether it was cut.

    The turns are found by rendering the conversation's prefixes: an assistant turn is what rendering it adds
    to the text before it with the generation prompt. A template whose prefixes are not prefixes of the whole
    (one that rewrites earlier turns), and a tokenizer without character offsets (not a "fast" one), get the
    whole conversation's loss instead, as "all" does."""
    text = tok.apply_chat_template(messages, tokenize=False)
    masked = train_on != "all" and getattr(tok, "is_fast", False)  # offsets come with the fast tokenizers only
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=masked)
    ids: list[int] = enc["input_ids"]
    labels = list(ids)
    if masked:
        spans = _assistant_spans(tok, messages, text)
        if spans is not None:
            labels = [
                t if any(a <= start < b for a, b in spans) else IGNORE
                for t, (start, _) in zip(ids, enc["offset_mapping"], strict=True)
            ]
    cut = len(ids) > max_len
    return (ids[:max_len], labels[:max_len]), cut


def _assistant_spans(tok, messages: list[dict], text: str) -> list[tuple[int, int]] | None:
    """The character spans of the assistant turns in `text`, or None when the template's prefixes do not line up
    (or it refuses to render one: some templates want a conversation to end on a given role)."""
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        try:
            before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
            upto = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        except Exception:  # jinja2's TemplateError and whatever a template raises itself
            return None
        if not (text.startswith(upto) and upto.startswith(before)):
            return None
        spans.append((len(before), len(upto)))
    return spans


def _encode(tok, examples: list[list[dict]], max_len: int, train_on: str) -> tuple[list[Example], int, int]:
    """The examples encoded, how many were cut to `max_len`, and how many were left out because nothing they
    would teach is left within it (their assistant turns lie past the cut)."""
    out, cut, empty = [], 0, 0
    for messages in examples:
        example, was_cut = encode_example(tok, messages, max_len, train_on)
        cut += was_cut
        if any(t != IGNORE for t in example[1][1:]):  # the first token is never predicted
            out.append(example)
        else:
            empty += 1
    return out, cut, empty


def context_of(model, tok) -> int:
    """The longest sequence the model takes: its config's positions, else the tokenizer's limit, else 2048."""
    for n in (getattr(model.config, "max_position_embeddings", None), getattr(tok, "model_max_length", None)):
        if isinstance(n, int) and 0 < n < 10**7:
            return n
    return 2048


def _batch(torch, examples: list[Example], pad: int, device, parts: list[list[int]] | None = None):
    """(input ids, attention mask, labels, position ids, real tokens) of a step's rows, padded to the longest.
    `parts`: each row's example lengths when rows are packs (`pack`): then the mask is 4-D and block-diagonal (a
    token sees only the earlier tokens of its own example) and the positions start again at each example, so a
    pack's logits are its examples' own, as if each ran alone; else the mask is the usual 2-D one."""
    n = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), n), pad, dtype=torch.long)
    mask = torch.zeros((len(examples), n), dtype=torch.long)
    labels = torch.full((len(examples), n), IGNORE, dtype=torch.long)
    for i, (seq, lab) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, : len(lab)] = torch.tensor(lab)
    real = int(mask.sum().item())
    if parts is None:
        return ids.to(device), mask.to(device), labels.to(device), None, real
    seg = torch.empty((len(examples), n), dtype=torch.long)
    pos = torch.zeros((len(examples), n), dtype=torch.long)
    for i, lengths in enumerate(parts):
        at = 0
        for k, length in enumerate(lengths):
            seg[i, at : at + length] = k
            pos[i, at : at + length] = torch.arange(length)
            at += length
        seg[i, at:] = -1 - torch.arange(n - at)  # each padding position alone (a row with nothing to see is NaN)
    causal = torch.ones((n, n), dtype=torch.bool).tril()
    allow = (seg[:, :, None] == seg[:, None, :]) & causal
    return ids.to(device), allow[:, None].to(device), labels.to(device), pos.to(device), real


PACK_MAX_TOKENS = 8192  # a packed row's longest: its mask is rows x n x n booleans (64 MiB a row at 8,192)


def sequence_length(asked: int, context: int, batching: str) -> int:
    """The tokens an example (a packed row) may have: what the job asked (0: the model's context), never past the
    context, and packed rows at most PACK_MAX_TOKENS (their n x n mask: a 128k-token row would want 16 GiB)."""
    n = min(asked or context, context)
    return min(n, PACK_MAX_TOKENS) if batching == "pack" else n


def pack(lengths: list[int], max_len: int) -> list[list[int]]:
    """The examples (by index) in packs of at most `max_len` tokens in all, as few as best-fit decreasing finds:
    the longest first, each into the fullest pack it still fits. The same on every rank (no randomness)."""
    import bisect

    packs: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens left, pack index), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(room, (lengths[i], -1))
        if at < len(room):
            left, p = room.pop(at)
            packs[p].append(i)
            left -= lengths[i]
        else:
            packs.append([i])
            p, left = len(packs) - 1, max_len - lengths[i]
        if left > 0:
            bisect.insort(room, (left, p))
    return packs


def packed(examples: list[Example], packs: list[list[int]]) -> tuple[list[Example], list[list[int]]]:
    """Each pack as one row (its examples' tokens one after another; each example's first token predicted by
    nothing, as when it runs alone) and each row's example lengths, for `_batch`."""
    rows, parts = [], []
    for members in packs:
        ids: list[int] = []
        labels: list[int] = []
        for i in members:
            seq, lab = examples[i]
            ids += seq
            labels += [IGNORE, *lab[1:]]
        rows.append((ids, labels))
        parts.append([len(examples[i][0]) for i in members])
    return rows, parts


def validation_loss(model, examples: list[Example], device) -> tuple[float, int]:
    """(summed token loss, predicted tokens) of `examples`, one at a time (no padding to account for), over the
    tokens their labels count, without gradients; the model is put back in the train/eval mode it was in."""
    import torch

    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad():
            for seq, lab in examples:
                n = sum(1 for t in lab[1:] if t != IGNORE)  # the model shifts the labels: the first predicts nothing
                if n == 0:
                    continue
                ids = torch.tensor([seq], dtype=torch.long, device=device)
                labels = torch.tensor([lab], dtype=torch.long, device=device)
                total += model(input_ids=ids, labels=labels).loss.float().item() * n
                count += n
    finally:
        model.train(was_training)
    return total, count


def plan_steps(n_examples: int, world: int, batch_size: int, n_epochs: int) -> tuple[int, int]:
    """(steps per epoch, total steps): every rank runs the same number of steps, `batch_size` examples each."""
    per_epoch = max(1, math.ceil(math.ceil(n_examples / world) / batch_size))
    return per_epoch, per_epoch * n_epochs


BUCKET_WINDOW_STEPS = 64  # steps whose examples are sorted by length together: batches of like lengths, still mixed


def epoch_order(lengths: list[int], seed: int, epoch: int, batch_size: int, world: int, bucket: bool) -> list[int]:
    """The epoch's example order, the same on every rank (seeded). Shuffled; with `bucket`, each window of
    BUCKET_WINDOW_STEPS steps is then sorted by length and cut into steps (`batch_size` examples on each of `world`
    ranks, which `rank_batch` shares out), and the steps are shuffled: a batch holds examples of like lengths, so
    little of it is padding, and the order of lengths is still random."""
    rng = random.Random(seed * 1000 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    group = batch_size * world
    if not bucket or batch_size == 1:
        return order
    window = group * BUCKET_WINDOW_STEPS
    out: list[int] = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: lengths[i])
        steps = [chunk[k : k + group] for k in range(0, len(chunk), group)]
        rng.shuffle(steps)
        out += [i for step in steps for i in step]
    return out


def padding_share(order: list[int], lengths: list[int], per_epoch: int, batch_size: int, world: int) -> float:
    """The share of an epoch's batch positions that are padding, over every rank."""
    real = padded = 0
    for s in range(per_epoch):
        for rank in range(world):
            batch = [lengths[i] for i in rank_batch(order, s, rank, world, batch_size)]
            real += sum(batch)
            padded += max(batch) * len(batch)
    return 1 - real / padded if padded else 0.0


def rank_batch(order: list[int], step_in_epoch: int, rank: int, world: int, batch_size: int) -> list[int]:
    """The example indices rank `rank` trains on at this step: a strided share of the epoch's order, wrapping
    round when the examples do not divide evenly (every rank always has a full batch)."""
    n = len(order)
    base = step_in_epoch * batch_size * world
    return [order[(base + j * world + rank) % n] for j in range(batch_size)]


def train(spec: TrainSpec, data_path: Path, out: Path, valid_path: Path | None = None) -> None:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if spec.method == "qlora" and not qlora_backend(cuda):
        raise SystemExit(
            "QLoRA needs bitsandbytes on every training node (0.47 or later to run on the CPU, else a CUDA GPU); "
            'this node has neither (use method "lora")'
        )
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    url = f"tcp://{spec.master_addr}:{spec.master_port}"
    _collective(
        dist.init_process_group,
        backend,
        init_method=url,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        tok = AutoTokenizer.from_pretrained(spec.base_path)
        kwargs: dict = {"dtype": torch.float32}
        if spec.method == "qlora":
            from peft import prepare_model_for_kbit_training
            from transformers import BitsAndBytesConfig

            kwargs = {
                "quantization_config": BitsAndBytesConfig(
                    load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
                ),
                "device_map": {"": 0 if cuda else "cpu"},
            }
        model = AutoModelForCausalLM.from_pretrained(spec.base_path, **kwargs)
        if spec.method == "qlora":
            model = prepare_model_for_kbit_training(model)
        elif cuda:
            to_device(model, device)  # in place, as nn.Module.to is
        torch.manual_seed(spec.seed)
        lora = LoraConfig(
            r=spec.lora_rank,
            lora_alpha=spec.lora_alpha,
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # one start for every rank, whatever their RNGs did
            _collective(dist.broadcast, p.data, src=0)
        hp = spec.hyperparameters
        context = context_of(model, tok)
        max_len = sequence_length(hp.max_seq_len, context, hp.batching)
        examples, cut, empty = _encode(tok, parse_examples(data_path.read_bytes()), max_len, hp.train_on)
        if not examples:
            raise SystemExit(
                f"no training example has an assistant token within the first {max_len} tokens "
                "(hyperparameters.max_seq_len): nothing to learn"
            )
        valid = _encode(tok, parse_examples(valid_path.read_bytes()), max_len, hp.train_on)[0] if valid_path else []
        mine = valid[spec.rank :: spec.world_size]  # this rank's share of the validation examples
        n_examples, parts = len(examples), None
        if hp.batching == "pack":  # several examples a row, each seeing only itself: fewer, fuller rows
            examples, parts = packed(examples, pack([len(ids) for ids, _ in examples], max_len))
        per_epoch, total = plan_steps(len(examples), spec.world_size, hp.batch_size, hp.n_epochs)
        opt = torch.optim.AdamW(params, lr=BASE_LEARNING_RATE * hp.learning_rate_multiplier, weight_decay=0.0)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        model.train()
        say(
            event="started",
            total_steps=total,
            examples=n_examples,
            valid_examples=len(valid),
            backend=backend,
            max_seq_len=max_len,
            cut_examples=cut,
            left_out=empty,
            train_on=hp.train_on,
        )
        step = 0
        trained = 0
        lengths = [len(ids) for ids, _ in examples]
        bucket = hp.batching != "shuffle"  # packs of unlike totals are bucketed as examples are
        for epoch in range(hp.n_epochs):
            order = epoch_order(lengths, spec.seed, epoch, hp.batch_size, spec.world_size, bucket)
            if epoch == 0:
                waste = padding_share(order, lengths, per_epoch, hp.batch_size, spec.world_size)
                packs = {"packs": len(examples)} if parts is not None else {}
                say(event="batching", batching=hp.batching, padding=round(waste, 4), **packs)
            for s in range(per_epoch):
                t0 = time.monotonic()
                rows = rank_batch(order, s, spec.rank, spec.world_size, hp.batch_size)
                seqs = [examples[i] for i in rows]
                row_parts = [parts[i] for i in rows] if parts is not None else None
                ids, mask, labels, pos, real = _batch(torch, seqs, pad, device, row_parts)
                loss = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss
                loss.backward()
                grads: list[torch.Tensor] = []
                for p in params:
                    assert p.grad is not None, "backward() gives every trainable (LoRA) weight its gradient"
                    grads.append(p.grad)
                flat = torch.cat([g.reshape(-1) for g in grads])
                _collective(dist.all_reduce, flat)  # one message a step: the whole LoRA gradient
                flat /= spec.world_size
                off = 0
                for g in grads:
                    n = g.numel()
                    g.copy_(flat[off : off + n].view_as(g))
                    off += n
                opt.step()
                opt.zero_grad(set_to_none=False)
                stats = torch.tensor([loss.detach().float().item(), float(real)], device=device)
                _collective(dist.all_reduce, stats)
                step += 1
                tokens = int(stats[1].item())
                trained += tokens
                dt = max(time.monotonic() - t0, 1e-6)
                extra = {}
                if valid and s == per_epoch - 1:  # the epoch's end (the last one is the end of training)
                    vsum, vcount = validation_loss(model, mine, device)
                    vstats = torch.tensor([vsum, float(vcount)], dtype=torch.float64, device=device)
                    _collective(dist.all_reduce, vstats)
                    if vstats[1].item() > 0:
                        extra["valid_loss"] = round(vstats[0].item() / vstats[1].item(), 6)
                say(
                    event="step",
                    step=step,
                    total_steps=total,
                    loss=round(stats[0].item() / spec.world_size, 6),
                    tokens_per_s=round(tokens / dt, 1),
                    trained_tokens=trained,
                    **extra,
                )
        digest = adapter_digest(model)
        tmp = out / f".adapter.{os.getpid()}"
        model.save_pretrained(str(tmp))
        # the base's architecture beside the adapter: llama.cpp's converter reads it where the adapter is served on
        # llama-server, on a node that may hold only the base's GGUF (engines/lora_gguf.py)
        (tmp / "base_config.json").write_bytes((Path(spec.base_path) / "config.json").read_bytes())
        final = out / "adapter"
        if final.exists():
            import shutil

            shutil.rmtree(final)
        tmp.rename(final)
        _collective(dist.barrier)  # no rank reports done before every rank has its adapter
        say(event="done", digest=digest, total_steps=total, trained_tokens=trained)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group may refuse to be destroyed; the process ends anyway
            pass


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    ap = argparse.ArgumentParser(
        prog="python -m coderai.engine_worker.trainer", description=(__doc__ or "").partition("\n")[0]
    )
    ap.add_argument("--spec", required=True, help="the TrainSpec as JSON, in a file")
    ap.add_argument("--data", required=True, help="the training JSONL file")
    ap.add_argument("--valid", default="", help="the validation JSONL file (optional)")
    ap.add_argument("--out", required=True, help="a folder for the adapter")
    a = ap.parse_args(argv)
    spec = decode(Path(a.spec).read_bytes(), TrainSpec)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        train(spec, Path(a.data), out, Path(a.valid) if a.valid else None)
    except PeerFailed as exc:
        say(event="failed", peer=True, message=f"lost a peer rank: {exc}")
        return 1
    except SystemExit as exc:
        if exc.code in (0, None):
            raise
        say(event="failed", message=str(exc.code))
        return 1
    except Exception as exc:  # the outermost edge of the trainer: report it, typed
        say(event="failed", message=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
