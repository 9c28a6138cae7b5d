"""Fine-tuning: uploaded training files, fine-tuning jobs and their events, and the scheduler's rendezvous with
the workers that train data-parallel (`coderai.cmd.node.<id>.train`, progress on `coderai.train.report.<job>`,
the adapter up into the head's store on `coderai.train.upload.<job>`). No I/O here.

Records live in the `coderai_finetune` KV bucket (files under `file-...`, jobs under `ftjob-...`), so every
gateway replica answers a GET; the scheduler is the only writer of job records, the gateway of file records.
"""

from __future__ import annotations

from typing import Literal

from coderai.contracts.base import Message

Method = Literal["lora", "qlora"]
TrainOn = Literal["assistant", "all"]
Batching = Literal["bucket", "shuffle", "pack"]
JobStatus = Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL: frozenset[JobStatus] = frozenset({"succeeded", "failed", "cancelled"})

MAX_EVENTS = 200
"""Events kept in a job record (oldest dropped): a record must stay far under NATS' 1 MB payload."""

BASE_LEARNING_RATE = 2e-4
"""What `learning_rate_multiplier` multiplies (a usual LoRA rate)."""


class Hyperparameters(Message, frozen=True, kw_only=True):
    """OpenAI's hyperparameters, resolved: what the job really trains with."""

    n_epochs: int = 3
    batch_size: int = 1
    learning_rate_multiplier: float = 1.0
    # coderai's: the longest example trained on, in tokens (longer ones are cut; 0: the model's own context),
    # and whose tokens the loss counts ("assistant": the assistant turns only; "all": every token)
    max_seq_len: int = 0
    train_on: TrainOn = "assistant"
    # how an epoch's examples make batches: "bucket" (of similar lengths, so little of a batch is padding; the
    # steps in random order), "shuffle" (in random order, whatever their lengths), "pack" (several examples a row
    # of up to max_seq_len tokens, each seeing only itself; the rows then bucketed)
    batching: Batching = "bucket"


class FileRecord(Message, frozen=True, kw_only=True):
    """An uploaded file: its bytes are the object `id` in the `coderai_files` object store."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    examples: int = 0  # lines of a checked fine-tune file
    owner: str = ""  # the API key that uploaded it: only it (or an admin key) lists, reads or deletes it


class JobError(Message, frozen=True, kw_only=True):
    code: str
    message: str
    param: str | None = None


class JobEvent(Message, frozen=True, kw_only=True):
    """One `fine_tuning.job.event`: `type` "metrics" events carry step, loss and throughput in `data`."""

    id: str
    created_at: int
    level: Literal["info", "warn", "error"] = "info"
    message: str
    type: Literal["message", "metrics"] = "message"
    data: dict[str, object] = {}


class FineTuneJob(Message, frozen=True, kw_only=True):
    """A fine-tuning job's record (the KV value): what was asked, where it runs, how it went."""

    id: str
    model: str
    training_file: str
    validation_file: str | None = None
    suffix: str = ""
    method: Method = "lora"
    lora_rank: int = 8
    lora_alpha: int = 16
    seed: int = 0
    hyperparameters: Hyperparameters = Hyperparameters()
    status: JobStatus = "queued"
    created_at: int
    finished_at: int | None = None
    updated_at: float = 0.0
    nodes: list[str] = []  # by rank
    fine_tuned_model: str | None = None
    trained_tokens: int | None = None
    valid_loss: float | None = None  # the last mean loss over the validation file (at the end of training)
    error: JobError | None = None
    key_name: str = ""
    events: list[JobEvent] = []  # oldest first, at most MAX_EVENTS


class FineTuneCreate(Message, frozen=True, kw_only=True):
    """Gateway -> scheduler (`coderai.cmd.scheduler.train`): start a job; the reply is its first record."""

    job_id: str
    model: str
    training_file: str
    validation_file: str | None = None
    suffix: str = ""
    method: Method = "lora"
    nodes: int = 0  # how many nodes train it; 0: every node that can
    lora_rank: int = 8
    lora_alpha: int = 16
    seed: int = 0
    hyperparameters: Hyperparameters = Hyperparameters()
    key_name: str = ""


class FineTuneCancel(Message, frozen=True, kw_only=True):
    job_id: str


class FineTuneReply(Message, frozen=True, kw_only=True, tag="finetune.job", tag_field="t"):
    job: FineTuneJob


class TrainSpec(Message, frozen=True, kw_only=True):
    """Scheduler -> worker (`coderai.cmd.node.<id>.train`): one rank of a job. Rank 0's worker picks the
    rendezvous port and answers its address; the other ranks get it in `master_addr` / `master_port`."""

    job_id: str
    rank: int
    world_size: int
    master_addr: str = ""
    master_port: int = 0
    base_path: str  # the base model's Hugging Face folder on the node
    data_store_path: str  # the training file in the head's model store
    valid_store_path: str = ""  # the validation file there ("" when the job has none)
    adapter_store_path: str  # where rank 0 uploads the adapter (a tar of the peft folder)
    method: Method = "lora"
    lora_rank: int = 8
    lora_alpha: int = 16
    seed: int = 0
    hyperparameters: Hyperparameters = Hyperparameters()


class TrainStarted(Message, frozen=True, kw_only=True, tag="train.started", tag_field="t"):
    node_id: str
    rank: int
    master_addr: str
    master_port: int


class TrainStop(Message, frozen=True, kw_only=True):
    """Scheduler -> worker: end this job's trainer now (cancelled, or another rank failed)."""

    job_id: str
    reason: str = ""


class TrainStopped(Message, frozen=True, kw_only=True, tag="train.stopped", tag_field="t"):
    node_id: str
    was_running: bool


ReportKind = Literal["alive", "step", "done", "failed"]


class TrainReport(Message, frozen=True, kw_only=True):
    """Worker -> scheduler, published: `alive` every second while a rank runs, `step` (rank 0) with the loss
    averaged over ranks (and at each epoch's end the validation loss, when there is a validation file), `done` with the adapter's digest, `failed` with why. `peer` marks a failure seen in a
    collective (another rank went away), so the scheduler can name the rank that really failed."""

    job_id: str
    node_id: str
    rank: int
    kind: ReportKind
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    valid_loss: float | None = None  # at an epoch's last step, when the job has a validation file
    tokens_per_s: float | None = None
    trained_tokens: int = 0
    digest: str = ""  # sha256 over the adapter's tensors: equal on every rank of a correct job
    message: str = ""
    peer: bool = False


class TrainStateAsk(Message, frozen=True, kw_only=True):
    """Scheduler -> worker (`coderai.cmd.node.<id>.train_state`): what became of this job's rank here? A scheduler
    that restarted while the job ran asks every rank once, so what they published while no scheduler listened (the
    reports are core NATS, not kept) is not lost."""

    job_id: str


class TrainState(Message, frozen=True, kw_only=True, tag="train.state", tag_field="t"):
    """A rank's answer: `known` False when this worker never ran the job or has forgotten it (it restarted);
    `running` while its trainer (or rank 0's upload) still goes on; `reports` its last step reports (oldest first, at
    most MAX_EVENTS) and then its final `done` / `failed` report, if it has one."""

    node_id: str
    rank: int = -1
    known: bool = False
    running: bool = False
    reports: list[TrainReport] = []


class AdapterChunk(Message, frozen=True, kw_only=True):
    """Rank 0 -> scheduler (`coderai.train.upload.<job>`): bytes of the adapter tar at `offset`. The last chunk
    gives the whole file's `size` and `sha256`; only then does the file get its final name."""

    job_id: str
    node_id: str = ""  # rank 0's node: the subject carries it too, and only that node may publish there
    offset: int
    data: bytes = b""
    size: int = 0
    sha256: str = ""


class AdapterAck(Message, frozen=True, kw_only=True, tag="adapter.ack", tag_field="t"):
    received: int
    complete: bool = False
