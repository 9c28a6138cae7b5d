"""Pure fine-tuning logic for the scheduler: which nodes train a job and in which rank order, who is to blame
when a job breaks, the job record's events, and the model config that serves the result."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Literal

import msgspec
from coderai.contracts import BusError, Heartbeat, ModelConfig
from coderai.contracts.params import as_int
from coderai.contracts.training import (
    MAX_EVENTS,
    TERMINAL,
    FileRecord,
    FineTuneJob,
    JobEvent,
    Method,
    TrainReport,
    TrainState,
)

SILENT_S = 10.0
"""A rank whose worker sent no report for this long is dead (reports come every second)."""

PEER_GRACE_S = SILENT_S + 2.0
"""A rank that lost its peers is blamed only if no other rank was found failed or silent within this long."""

SUFFIX = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def eligible_nodes(nodes: dict[str, Heartbeat], base: ModelConfig, method: Method) -> list[str]:
    """Live owned nodes that can train `base` with `method`: they have the `train` capability (and `qlora` for
    QLoRA). The base model's `nodes` say where it is served, not where its folder is, so they do not restrict
    training. BusError no_engine when no node can train, bad_request when QLoRA has no node."""
    can = sorted(n for n, hb in nodes.items() if not hb.pod and "train" in hb.capabilities)
    if not can:
        raise BusError(
            "no_engine",
            f"no live node can fine-tune {base.name!r}: training needs the `finetune` extra "
            "(torch, transformers, peft) on a node",
            retryable=True,
        )
    if method == "qlora":
        q = [n for n in can if "qlora" in nodes[n].capabilities]
        if not q:
            raise BusError(
                "bad_request",
                "QLoRA needs bitsandbytes on the training nodes (0.47 or later runs it on the CPU; before, only "
                f'on a CUDA GPU); none of {", ".join(can)} has it. Use method "lora".',
                param="method",
            )
        return q
    return can


def choose_ranks(eligible: list[str], want: int, holders: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The nodes of the job in rank order: nodes already serving the base model first (rank 0 among them), then by
    id; `want` of them (0: all). BusError bad_request when more are asked than can train."""
    if want < 0:
        raise BusError("bad_request", "nodes must be 0 (every node that can train) or more", param="nodes")
    if want > len(eligible):
        raise BusError(
            "bad_request",
            f"{want} nodes asked, but only {len(eligible)} can train this model ({', '.join(eligible)})",
            param="nodes",
        )
    ordered = sorted(eligible, key=lambda n: (n not in holders, n))
    return ordered[: want or len(ordered)]


def check_file(rec: FileRecord | None, file_id: str, param: str) -> FileRecord:
    """The uploaded file a job names as `param` (`training_file` or `validation_file`): it must exist and be a
    `fine-tune` upload (checked line by line when it was uploaded). BusError bad_request naming `param`."""
    if rec is None:
        raise BusError("bad_request", f"No file '{file_id}' was uploaded.", param=param)
    if rec.purpose != "fine-tune":
        raise BusError("bad_request", f"File {file_id} was uploaded for {rec.purpose!r}, not 'fine-tune'.", param=param)
    return rec


def step_event(
    step: int, total: int, loss: float, tokens_per_s: float, trained: int, valid_loss: float | None
) -> tuple[str, dict]:
    """A step's metrics event (message, data), in OpenAI's keys. At an epoch's end, with a validation file, it
    also has `valid_loss` and `full_valid_loss`: both the mean token loss over the whole validation file."""
    data: dict = {
        "step": step,
        "total_steps": total,
        "train_loss": loss,
        "tokens_per_s": tokens_per_s,
        "trained_tokens": trained,
    }
    said = f"Step {step}/{total}: training loss={loss:.4f}"
    if valid_loss is not None:
        data["valid_loss"] = data["full_valid_loss"] = valid_loss
        said += f", validation loss={valid_loss:.4f}"
    return f"{said}, {tokens_per_s:.0f} tokens/s", data


def finetuned_name(base: str, suffix: str, job_id: str) -> str:
    """`<base>:<suffix>-<the first 8 characters of the job's random id>` (OpenAI's `ft:<base>:<org>:<suffix>:<id>`
    in one tag); without a suffix the whole job id stands in. The id makes each name its own job's: a key that
    chooses a suffix another key's model has gets a name of its own, not word that the other exists."""
    if not suffix:
        return f"{base}:{job_id}"
    return f"{base}:{suffix}-{job_id.removeprefix('ftjob-')[:8]}"


FINE_TUNABLE = ("transformers", "vllm")  # engines that serve a base model with a LoRA adapter (`params.base`)
# llama-server serves a GGUF base with the adapter as a GGUF LoRA; training reads the Hugging Face folder the GGUF
# was made from, which the model names as `hf_path`
GGUF_TUNABLE = "llama-server"


def train_path(base: ModelConfig) -> str:
    """The Hugging Face folder the trainer loads: the model's own, or a GGUF model's `hf_path`."""
    if base.engine == GGUF_TUNABLE:
        return base.param_str("hf_path") or ""
    return base.path


def check_base(base: ModelConfig) -> None:
    """A model fine-tuning can start from: a Hugging Face folder on an engine that serves it with the adapter, or a
    llama-server GGUF that names the folder it was made from."""
    if base.engine == GGUF_TUNABLE and not base.param_str("hf_path"):
        raise BusError(
            "bad_request",
            f"The model '{base.name}' is a GGUF on llama-server without `hf_path`: fine-tuning trains on the "
            "Hugging Face folder the GGUF was made from, which its models-file entry must name as params.hf_path.",
            param="model",
        )
    if base.engine not in (*FINE_TUNABLE, GGUF_TUNABLE):
        engines = " or ".join(f'"{e}"' for e in (*FINE_TUNABLE, GGUF_TUNABLE))
        raise BusError(
            "bad_request",
            f"The model '{base.name}' runs on engine {base.engine}; fine-tuning needs a Hugging Face model served "
            f"by engine {engines} (a GGUF on llama-server with params.hf_path).",
            param="model",
        )


def check_suffix(suffix: str) -> None:
    if suffix and not SUFFIX.match(suffix):
        raise BusError("bad_request", "suffix may hold only letters, digits, '-' and '_', at most 64", param="suffix")


def finetuned_config(
    base: ModelConfig, name: str, adapter_path: str, store_path: str, created: int, base_bytes: int = 0, owner: str = ""
) -> ModelConfig:
    """The base model's config serving base + adapter: a node without the head's adapter file fetches it from the
    store like any model file; the base folder is read where the base model is. It is `owner`'s, the key that
    trained it: no other tenant lists or uses it."""
    memory_mb = base.memory_mb
    if not memory_mb and base_bytes:  # the adapter file is small; what a copy needs is the base model
        memory_mb = (int(base_bytes * 1.2) >> 20) + 256
    return msgspec.structs.replace(
        base,
        name=name,
        path=adapter_path,
        store_path=store_path,
        params={**base.params, "base": base.path},
        created=created,
        owned_by="coderai-finetune",
        owner=owner,
        memory_mb=memory_mb,
        pin="",
    )


def add_event(
    job: FineTuneJob,
    message: str,
    *,
    level: Literal["info", "warn", "error"] = "info",
    type_: Literal["message", "metrics"] = "message",
    data: dict | None = None,
    now: float | None = None,
) -> FineTuneJob:
    """`job` with one more event (ids count up per job; the oldest beyond MAX_EVENTS are dropped)."""
    now = time.time() if now is None else now
    seq = int(job.events[-1].id.rsplit("-", 1)[-1]) + 1 if job.events else 1
    evt = JobEvent(
        id=f"ftevent-{job.id.removeprefix('ftjob-')}-{seq}",
        created_at=int(now),
        level=level,
        message=message,
        type=type_,
        data=data or {},
    )
    return msgspec.structs.replace(job, events=[*job.events, evt][-MAX_EVENTS:], updated_at=now)


@dataclass
class Rank:
    """What the scheduler knows of one rank of a running job."""

    rank: int
    node_id: str
    last_seen: float
    digest: str = ""
    done: bool = False
    failed: str = ""
    peer: bool = False
    failed_at: float = 0.0


def verdict(ranks: list[Rank], now: float, silent_s: float = SILENT_S, grace_s: float = PEER_GRACE_S) -> str:
    """Why the job has failed ("" while it has not), naming the rank and node at fault. A rank that failed by
    itself is blamed at once; one that went silent (its worker or node died) after `silent_s`; a rank that only
    lost its peers (a collective broke) after `grace_s`, when nobody else was found at fault first."""
    for r in ranks:
        if r.failed and not r.peer:
            return f"rank {r.rank} on node {r.node_id} failed: {r.failed}"
    for r in ranks:
        if not r.done and not r.failed and now - r.last_seen > silent_s:
            return (
                f"rank {r.rank} on node {r.node_id} stopped reporting {now - r.last_seen:.0f}s ago "
                "(its node, worker or trainer died)"
            )
    for r in ranks:
        if r.failed and r.peer and now - r.failed_at > grace_s:
            return f"rank {r.rank} on node {r.node_id} failed: {r.failed}"
    return ""


def finished(ranks: list[Rank]) -> str | None:
    """None while some rank is still training; "" when every rank is done with one adapter; else why not."""
    if not all(r.done for r in ranks):
        return None
    digests = {r.digest for r in ranks}
    if len(digests) != 1:
        return "the ranks ended with different adapters: " + ", ".join(f"{r.node_id}={r.digest[:12]}" for r in ranks)
    return ""


def ranks_of(nodes: list[str], now: float) -> list[Rank]:
    """A job's ranks (its `nodes`, in rank order), each seen `now`: a fresh grace period before silence counts."""
    return [Rank(rank=i, node_id=n, last_seen=now) for i, n in enumerate(nodes)]


@dataclass(frozen=True)
class Adoption:
    """What a (re)started scheduler does with a job record it finds in the bucket."""

    action: str  # "leave" (terminal) | "adopt" (ranks run: follow them) | "restart" (start its ranks) | "fail"
    base: ModelConfig | None = None
    name: str = ""  # the model it becomes
    message: str = ""  # why it fails


def adoption(job: FineTuneJob, models: list[ModelConfig]) -> Adoption:
    """A job left by a previous scheduler. Terminal jobs are left alone. A `running` job's ranks were all started
    and their workers kept training while no scheduler ran: it is adopted (followed again from its record). A job
    caught before that (`validating_files`, `queued`: files being staged, ranks maybe half started) is started
    again from its files, on the nodes it was given; nothing of it had trained yet. Either fails when its base
    model is no longer configured. The model's name is derived as at creation (`finetuned_name`)."""
    if job.status in TERMINAL:
        return Adoption("leave")
    base = next((m for m in models if m.name == job.model), None)
    if base is None:
        return Adoption("fail", message=f"the scheduler restarted and no longer serves the base model {job.model!r}")
    if not job.nodes:
        return Adoption("fail", message="the scheduler restarted and the job names no nodes to train on")
    return Adoption(
        "adopt" if job.status == "running" else "restart", base, finetuned_name(base.name, job.suffix, job.id)
    )


def last_step(job: FineTuneJob) -> int:
    """The highest step a metrics event of `job` records (0: none yet)."""
    return max(
        (as_int(e.data.get("step", 0), "a metrics event's step") for e in job.events if e.type == "metrics"), default=0
    )


def missed(job: FineTuneJob, rank: Rank, state: TrainState) -> list[TrainReport]:
    """The reports of `rank` that a restarted scheduler did not see, from the rank's answered state: its step
    reports past the last step the job records, then its final one. A worker that no longer knows the job (it
    restarted too) or whose rank was stopped without an outcome gives a `failed` report naming why."""
    if not state.known:
        return [
            TrainReport(
                job_id=job.id,
                node_id=rank.node_id,
                rank=rank.rank,
                kind="failed",
                message="its worker no longer runs the job (it restarted while the scheduler was away)",
            )
        ]
    seen = last_step(job)
    out = [r for r in state.reports if r.kind == "step" and r.step > seen]
    final = [r for r in state.reports if r.kind in ("done", "failed")]
    out += final[-1:]
    if not state.running and not final:
        out.append(
            TrainReport(
                job_id=job.id,
                node_id=rank.node_id,
                rank=rank.rank,
                kind="failed",
                message="its trainer was stopped while the scheduler was away",
            )
        )
    return [r for r in out if r.job_id == job.id and r.rank == rank.rank and r.node_id == rank.node_id]
