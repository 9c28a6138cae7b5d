"""Fine-tuning jobs, scheduler side: rendezvous, state, failure, and serving the result.

A job is created by a gateway (`coderai.cmd.scheduler.train`): the training file (and the validation file, when
the job has one) is copied from the `coderai_files` object store into the head's model store (nodes fetch it like
a model file), the nodes are chosen and given ranks, rank 0 is started first and answers the rendezvous address,
then every other rank gets it. The ranks' workers report every second; a rank that fails or goes silent fails
the job naming its node, and the other ranks are stopped. When every rank is done with the same adapter digest and rank 0's upload has landed (written
under a temporary name, renamed only after its sha256 checked out), the model `<base>:<suffix>` is added through
the ordinary add-model path. Job records live in `coderai_finetune`; this service is their only writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import msgspec
from coderai.catalog.errors import CatalogError
from coderai.catalog.place import append_model
from coderai.contracts import BusError, ModelConfig, decode, encode
from coderai.contracts.admin import AddModelRequest
from coderai.contracts.subjects import (
    CMD_NODE_TRAIN,
    CMD_NODE_TRAIN_STOP,
    CMD_SCHEDULER_TRAIN,
    CMD_SCHEDULER_TRAIN_CANCEL,
    TRAIN_REPORT,
    TRAIN_UPLOAD,
)
from coderai.contracts.topology import FILES, FINETUNE
from coderai.contracts.training import (
    TERMINAL,
    AdapterAck,
    AdapterChunk,
    FileRecord,
    FineTuneCancel,
    FineTuneCreate,
    FineTuneJob,
    FineTuneReply,
    JobError,
    TrainReport,
    TrainSpec,
    TrainStop,
)
from coderai.runtime.files import sha256_file
from coderai.scheduler import training_plan as tp

log = logging.getLogger("coderai.scheduler")

START_TIMEOUT_S = 30.0
MONITOR_EVERY_S = 1.0


class _Live:
    """A running job's ranks and its adapter upload."""

    def __init__(self, ranks: list[tp.Rank], base: ModelConfig, name: str) -> None:
        self.ranks = ranks
        self.base = base
        self.name = name  # the model it becomes
        self.uploaded = ""  # the adapter's sha256 once its file is complete
        self.lock = asyncio.Lock()


class Training:
    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.live: dict[str, _Live] = {}
        self.jobs: dict[str, FineTuneJob] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def bus(self) -> Any:
        return self.sched.bus

    @property
    def root(self) -> Path:
        return self.sched.store.root

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        self.kv = await self.bus.kv(FINETUNE)
        await self._orphaned()
        for subject, handler in ((CMD_SCHEDULER_TRAIN, self._create), (CMD_SCHEDULER_TRAIN_CANCEL, self._cancel),
                                 (TRAIN_UPLOAD, self._upload)):
            sub = await self.bus.serve(subject, handler, queue="scheduler")
            stack.push_async_callback(sub.unsubscribe)
        sub = await self.bus.listen(TRAIN_REPORT, self._on_report)
        stack.push_async_callback(sub.unsubscribe)
        task = asyncio.create_task(self._monitor())
        stack.callback(task.cancel)

    async def _orphaned(self) -> None:
        """Jobs a previous scheduler left running cannot be followed any more: mark them failed."""
        try:
            keys = [k for k in await self.kv.keys() if k.startswith("ftjob-")]
        except Exception:  # noqa: BLE001 - nats-py raises NoKeysError on an empty bucket
            return
        for key in keys:
            job = decode((await self.kv.get(key)).value, FineTuneJob)
            if job.status not in TERMINAL:
                await self._save(self._failed(job, "scheduler_restarted", "the scheduler restarted while the job ran"))

    # --- records ----------------------------------------------------------------------------------

    async def _save(self, job: FineTuneJob) -> FineTuneJob:
        self.jobs[job.id] = job
        await self.kv.put(job.id, encode(job))
        return job

    def _failed(self, job: FineTuneJob, code: str, message: str) -> FineTuneJob:
        now = time.time()
        job = tp.add_event(job, f"Job failed: {message}", level="error", now=now)
        return msgspec.structs.replace(job, status="failed", error=JobError(code=code, message=message),
                                       finished_at=int(now))

    # --- create / cancel --------------------------------------------------------------------------

    async def _create(self, req: FineTuneCreate, _m: Any) -> FineTuneReply:
        base = next((m for m in self.sched.models if m.name == req.model), None)
        if base is None:
            raise BusError("bad_request", f"The model '{req.model}' does not exist.", param="model")
        if base.engine != "transformers":
            raise BusError("bad_request", f"The model '{req.model}' runs on engine {base.engine}; fine-tuning needs a "
                                          "Hugging Face model served by engine \"transformers\".", param="model")
        tp.check_suffix(req.suffix)
        name = tp.finetuned_name(base.name, req.suffix, req.job_id)
        taken = {m.name for m in self.sched.models} | {live.name for live in self.live.values()}
        taken |= {tp.finetuned_name(j.model, j.suffix, j.id) for j in self.jobs.values() if j.status not in TERMINAL}
        if name in taken:
            raise BusError("bad_request", f"A model named '{name}' exists already; choose another suffix.",
                           param="suffix")
        file = await self._file(req.training_file, "training_file")
        valid = await self._file(req.validation_file, "validation_file") if req.validation_file else None
        eligible = tp.eligible_nodes(self.sched.nodes, base, req.method)
        holders = {n for n, hb in self.sched.nodes.items() if any(e.model == base.name for e in hb.engines)}
        nodes = tp.choose_ranks(eligible, req.nodes, holders)
        now = time.time()
        job = FineTuneJob(id=req.job_id, model=base.name, training_file=file.id,
                          validation_file=valid.id if valid else None, suffix=req.suffix, method=req.method,
                          lora_rank=req.lora_rank, lora_alpha=req.lora_alpha, seed=req.seed,
                          hyperparameters=req.hyperparameters, status="validating_files", created_at=int(now),
                          updated_at=now, nodes=nodes, key_name=req.key_name)
        job = tp.add_event(job, f"Created fine-tuning job {job.id} ({req.method}, {len(nodes)} node(s))", now=now)
        await self._save(job)
        self._tasks.add(task := asyncio.create_task(self._run(job, base, name)))
        task.add_done_callback(self._tasks.discard)
        return FineTuneReply(job=job)

    async def _file(self, file_id: str, param: str) -> FileRecord:
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.kv.get(file_id) if file_id.startswith("file-") else None
        except KeyNotFoundError:
            entry = None
        return tp.check_file(decode(entry.value, FileRecord) if entry is not None and entry.value else None,
                             file_id, param)

    async def _cancel(self, req: FineTuneCancel, _m: Any) -> FineTuneReply:
        job = self.jobs.get(req.job_id) or await self._read_job(req.job_id)
        if job is None:
            raise BusError("not_found", f"No fine-tuning job '{req.job_id}'.", param="fine_tuning_job_id")
        if job.status in TERMINAL:
            raise BusError("bad_request", f"Job {job.id} is {job.status} already.", param="fine_tuning_job_id")
        job = tp.add_event(msgspec.structs.replace(job, status="cancelled", finished_at=int(time.time())),
                           "Job cancelled")
        await self._save(job)
        await self._stop_ranks(job, "cancelled")
        return FineTuneReply(job=job)

    async def _read_job(self, job_id: str) -> FineTuneJob | None:
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.kv.get(job_id)
        except KeyNotFoundError:
            return None
        return decode(entry.value, FineTuneJob) if entry.value else None

    async def _stop_ranks(self, job: FineTuneJob, reason: str) -> None:
        """Stop the job on every node it was given (a node that never started it answers `was_running: false`)."""
        self.live.pop(job.id, None)
        for node in job.nodes:
            with contextlib.suppress(BusError):
                await self.bus.request(CMD_NODE_TRAIN_STOP, TrainStop(job_id=job.id, reason=reason), timeout=10.0,
                                       node_id=node)
        (self.root / "finetune" / job.id / ".adapter.tar.partial").unlink(missing_ok=True)

    async def _fail(self, job_id: str, code: str, message: str) -> None:
        job = self.jobs.get(job_id)
        if job is None or job.status in TERMINAL:
            return
        log.error("fine-tuning job %s failed: %s", job_id, message)
        await self._save(self._failed(job, code, message))
        await self._stop_ranks(job, message)

    # --- running ----------------------------------------------------------------------------------

    async def _run(self, job: FineTuneJob, base: ModelConfig, name: str) -> None:
        try:
            data_path = f"finetune/{job.id}/train.jsonl"
            await self._copy_file(job.training_file, data_path)
            valid_path = f"finetune/{job.id}/valid.jsonl" if job.validation_file else ""
            if job.validation_file:  # moved to the nodes exactly like the training file
                await self._copy_file(job.validation_file, valid_path)
            if self.jobs[job.id].status in TERMINAL:  # cancelled meanwhile
                return
            job = await self._save(tp.add_event(msgspec.structs.replace(self.jobs[job.id], status="queued"),
                                                "Training and validation files checked and staged"
                                                if valid_path else "Training file checked and staged"))
            now = time.monotonic()
            ranks = [tp.Rank(rank=i, node_id=n, last_seen=now) for i, n in enumerate(job.nodes)]
            live = self.live[job.id] = _Live(ranks, base, name)
            spec = TrainSpec(job_id=job.id, rank=0, world_size=len(job.nodes), base_path=base.path,
                             data_store_path=data_path, valid_store_path=valid_path, adapter_store_path=f"finetune/{job.id}/adapter.tar",
                             method=job.method, lora_rank=job.lora_rank, lora_alpha=job.lora_alpha, seed=job.seed,
                             hyperparameters=job.hyperparameters)
            first = await self._start_rank(job, spec, live)
            if first is None:
                return
            for rank in range(1, len(job.nodes)):
                got = await self._start_rank(job, msgspec.structs.replace(
                    spec, rank=rank, master_addr=first.master_addr, master_port=first.master_port), live)
                if got is None:
                    return
            if self.jobs[job.id].status in TERMINAL:  # cancelled while its ranks were starting
                await self._stop_ranks(self.jobs[job.id], "cancelled")
                return
            where = ", ".join(f"{n} (rank {i})" for i, n in enumerate(job.nodes))
            said = f"Training on {where}; rendezvous at {first.master_addr}:{first.master_port}"
            job = await self._save(tp.add_event(msgspec.structs.replace(self.jobs[job.id], status="running"), said))
        except Exception as exc:  # noqa: BLE001 - the outermost edge of a job's start: fail it, typed
            log.exception("starting fine-tuning job %s failed", job.id)
            await self._fail(job.id, "start_failed", f"{type(exc).__name__}: {exc}")

    async def _start_rank(self, job: FineTuneJob, spec: TrainSpec, live: _Live) -> Any:
        node = job.nodes[spec.rank]
        live.ranks[spec.rank].last_seen = time.monotonic()
        try:
            return await self.bus.request(CMD_NODE_TRAIN, spec, timeout=START_TIMEOUT_S, node_id=node)
        except BusError as exc:
            await self._fail(job.id, "rank_failed", f"rank {spec.rank} on node {node} could not start: {exc.message}")
            return None

    async def _copy_file(self, file_id: str, store_path: str) -> None:
        """The uploaded file into the head's model store (temp name, then rename), where nodes fetch it."""
        obs = await self.bus.js.object_store(FILES.name)
        data = (await obs.get(file_id)).data
        dest = self.root / store_path
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dest)

    async def _on_report(self, rep: TrainReport, _m: Any) -> None:
        live = self.live.get(rep.job_id)
        job = self.jobs.get(rep.job_id)
        if live is None or job is None or job.status in TERMINAL or not 0 <= rep.rank < len(live.ranks):
            return
        r = live.ranks[rep.rank]
        if r.node_id != rep.node_id:
            log.warning("job %s: a report for rank %d came from %s, not %s", rep.job_id, rep.rank, rep.node_id,
                        r.node_id)
            return
        r.last_seen = time.monotonic()
        async with live.lock:
            job = self.jobs[rep.job_id]
            if rep.kind == "step":
                said, data = tp.step_event(rep.step, rep.total_steps, rep.loss or 0.0, rep.tokens_per_s or 0.0,
                                           rep.trained_tokens, rep.valid_loss)
                job = tp.add_event(job, said, type_="metrics", data=data)
                valid = rep.valid_loss if rep.valid_loss is not None else job.valid_loss
                await self._save(msgspec.structs.replace(job, trained_tokens=rep.trained_tokens, valid_loss=valid))
            elif rep.kind == "done":
                r.done, r.digest = True, rep.digest
                said = f"Rank {rep.rank} on {rep.node_id} finished (adapter {rep.digest[:12]})"
                await self._save(tp.add_event(job, said))
            elif rep.kind == "failed":
                r.failed, r.peer, r.failed_at = rep.message or "failed", rep.peer, time.monotonic()
        await self._check(rep.job_id)

    async def _check(self, job_id: str) -> None:
        live = self.live.get(job_id)
        if live is None:
            return
        why = tp.verdict(live.ranks, time.monotonic())
        if why:
            await self._fail(job_id, "rank_failed", why)
            return
        done = tp.finished(live.ranks)
        if done is None:
            return
        if done:
            await self._fail(job_id, "ranks_disagree", done)
            return
        if live.uploaded:
            await self._succeed(job_id)

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_EVERY_S)
            for job_id in list(self.live):
                try:
                    await self._check(job_id)
                except Exception as exc:  # noqa: BLE001 - checked again on the next tick
                    log.warning("checking fine-tuning job %s failed: %s", job_id, exc)

    async def _succeed(self, job_id: str) -> None:
        live = self.live.pop(job_id, None)
        job = self.jobs[job_id]
        if live is None or job.status in TERMINAL:
            return
        base, name = live.base, live.name
        store_path = f"finetune/{job_id}/adapter.tar"
        base_bytes = _folder_bytes(Path(os.path.expanduser(base.path)))
        cfg = tp.finetuned_config(base, name, str(self.root / store_path), store_path, int(time.time()), base_bytes)
        await self.sched._add(AddModelRequest(model=cfg), None)  # the one add-model path, as `models pull` uses
        job = await self._keep(job, cfg)
        now = time.time()
        job = msgspec.structs.replace(job, status="succeeded", fine_tuned_model=name, finished_at=int(now))
        await self._save(tp.add_event(job, f"New fine-tuned model created: {name}", now=now))
        log.info("fine-tuning job %s succeeded: serving %s", job_id, name)

    async def _keep(self, job: FineTuneJob, cfg: ModelConfig) -> FineTuneJob:
        """Append the new model to the scheduler's models file, so it is still served after a restart (the
        file is what a restart reads; `coderai models pull --place` does the same)."""
        if not self.sched.settings.models_file:
            return job
        try:
            entry = msgspec.to_builtins(cfg)
            await asyncio.to_thread(append_model, self.sched.settings.models_file, entry)
        except (CatalogError, OSError) as exc:
            log.warning("fine-tuning job %s: could not add %s to the models file: %s", job.id, cfg.name, exc)
            return tp.add_event(job, f"Serving {cfg.name} until the scheduler restarts: the models file could not "
                                     f"be updated ({exc})", level="warn")
        return job

    # --- the adapter upload -----------------------------------------------------------------------

    async def _upload(self, chunk: AdapterChunk, _m: Any) -> AdapterAck:
        """Rank 0 appends the adapter tar chunk by chunk; the last one names size and sha256, and only a file that
        matches both is renamed to its final name. Writes for jobs not running here are refused."""
        live = self.live.get(chunk.job_id)
        if live is None:
            raise BusError("bad_request", f"job {chunk.job_id} is not running: no upload taken")
        folder = self.root / "finetune" / chunk.job_id
        partial = folder / ".adapter.tar.partial"
        have = partial.stat().st_size if partial.exists() else 0
        if chunk.offset == 0:
            have = 0
            partial.unlink(missing_ok=True)
        if chunk.offset != have:
            raise BusError("bad_request", f"upload out of order: offset {chunk.offset}, have {have} bytes")
        folder.mkdir(parents=True, exist_ok=True)
        with open(partial, "ab") as fh:  # noqa: ASYNC230 - chunks of at most 512 KB
            fh.write(chunk.data)
        have += len(chunk.data)
        if not chunk.sha256:
            return AdapterAck(received=have)
        got = await asyncio.to_thread(sha256_file, partial)
        if have != chunk.size or got != chunk.sha256:
            partial.unlink(missing_ok=True)
            raise BusError("bad_request", f"adapter upload corrupted: {have} bytes sha256 {got[:12]}, "
                                          f"expected {chunk.size} bytes sha256 {chunk.sha256[:12]}")
        os.replace(partial, folder / "adapter.tar")
        live.uploaded = got
        async with live.lock:
            await self._save(tp.add_event(self.jobs[chunk.job_id], f"Adapter stored ({have} bytes)"))
        self._tasks.add(task := asyncio.create_task(self._check(chunk.job_id)))
        task.add_done_callback(self._tasks.discard)
        return AdapterAck(received=have, complete=True)


def _folder_bytes(folder: Path) -> int:
    try:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    except OSError:
        return 0
