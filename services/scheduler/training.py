"""Fine-tuning jobs, scheduler side: rendezvous, state, failure, and serving the result.

A job is created by a gateway (`coderai.cmd.scheduler.train`): the training file (and the validation file, when
the job has one) is copied from the `coderai_files` object store into the head's model store (nodes fetch it like
a model file), the nodes are chosen and given ranks, rank 0 is started first and answers the rendezvous address,
then every other rank gets it. The ranks' workers report every second; a rank that fails or goes silent fails
the job naming its node, and the other ranks are stopped. When every rank is done with the same adapter digest and rank 0's upload has landed (written
under a temporary name, renamed only after its sha256 checked out), the model `<base>:<suffix>` is added through
the ordinary add-model path. Job records live in `coderai_finetune`; this service is their only writer.

A scheduler restart does not fail a job: the workers (and their trainers) keep running meanwhile. The new
scheduler adopts every `running` job from its record (`training_plan.adoption`: ranks from `job.nodes`, the base
model from the models file, the model name derived as at creation), gives its ranks a fresh grace period and asks
each rank once for its state (`coderai.cmd.node.<id>.train_state`) before following reports again: reports are core
NATS, so a `step`, `done` or `failed` published while no scheduler listened is gone from the bus, but the worker
keeps its rank's reports and hands them over (see `_catch_up`). Asking is preferred over having ranks re-send
their final report until they see the job end: the answer also covers the steps of the gap, a worker that
restarted (it answers that it does not know the job), and it needs no acknowledgement protocol. The adapter upload
needs no such help: rank 0 retries it until the scheduler takes it (it reports `done` only after that), and a
file already renamed into place was complete and checked. A job caught before its ranks were started is started
again from its files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.msg import Msg
from coderai.accounts.keys import KeyJournal
from coderai.contracts import BusError, ModelConfig, decode, encode
from coderai.contracts.subjects import (
    CMD_NODE_TRAIN,
    CMD_NODE_TRAIN_STATE,
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
    TrainState,
    TrainStateAsk,
    TrainStop,
)
from coderai.runtime.files import sha256_file
from coderai.runtime.kv import read_all
from coderai.runtime.bus import Bus
from coderai.scheduler import training_plan as tp

if TYPE_CHECKING:
    from coderai.scheduler.service import Scheduler

log = logging.getLogger("coderai.scheduler")

START_TIMEOUT_S = 30.0
MONITOR_EVERY_S = 1.0
KEYS_EVERY_S = 5.0
"""How often the keys of running jobs are asked after (two KV reads a job): a revoked key's job is cancelled."""
STATE_TIMEOUT_S = 5.0
"""How long a restarted scheduler waits for a rank's state; a rank that does not answer is left to the silence
rule (its grace period started at adoption)."""


class _Live:
    """A running job's ranks and its adapter upload."""

    def __init__(self, ranks: list[tp.Rank], base: ModelConfig, name: str) -> None:
        self.ranks = ranks
        self.base = base
        self.name = name  # the model it becomes
        self.uploaded = ""  # the adapter's sha256 once its file is complete
        # held while an adopted job catches up on what its ranks did with no scheduler listening: live reports
        # wait behind it, so steps are recorded in order and none twice
        self.lock = asyncio.Lock()


class Training:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.live: dict[str, _Live] = {}
        self.jobs: dict[str, FineTuneJob] = {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def bus(self) -> Bus:
        return self.sched.connected_bus

    @property
    def root(self) -> Path:
        return self.sched.store.root

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        self.kv = await self.bus.kv(FINETUNE)
        adopted, later = await self._adopt()
        for live in adopted.values():
            await live.lock.acquire()  # released by _catch_up, once the gap is replayed
        for subject, handler in (
            (CMD_SCHEDULER_TRAIN, self._create),
            (CMD_SCHEDULER_TRAIN_CANCEL, self._cancel),
            (TRAIN_UPLOAD, self._upload),
        ):
            sub = await self.bus.serve(subject, handler, queue="scheduler")
            stack.push_async_callback(sub.unsubscribe)
        sub = await self.bus.listen(TRAIN_REPORT, self._on_report)
        stack.push_async_callback(sub.unsubscribe)
        task = asyncio.create_task(self._monitor())
        stack.callback(task.cancel)
        for job_id, live in adopted.items():  # subscribed first: nothing published from now on is missed
            self._spawn(self._catch_up(job_id, live))
        for coro in later:  # stopping ranks and starting jobs again waits on nodes: not in the way of starting
            self._spawn(coro)

    def _spawn(self, coro: Any) -> None:
        self._tasks.add(task := asyncio.create_task(coro))
        task.add_done_callback(self._tasks.discard)

    async def _adopt(self) -> tuple[dict[str, _Live], list[Any]]:
        """The jobs a previous scheduler left unfinished (`training_plan.adoption`): `running` ones are followed
        again (live state rebuilt from the record, a fresh grace period for every rank); ones caught before their
        ranks ran are stopped wherever a rank may have started and started again; the rest fail with a clear
        message. Terminal jobs are untouched. Returns the adopted jobs' live state, and what is to run once this
        service listens (stopping ranks, starting jobs again)."""
        adopted: dict[str, _Live] = {}
        later: list[Any] = []
        for job in (await read_all(self.kv, FineTuneJob, prefix="ftjob-")).values():
            plan = tp.adoption(job, self.sched.models)
            if plan.action == "leave":
                continue
            self.jobs[job.id] = job
            if plan.action == "fail":
                await self._save(self._failed(job, "scheduler_restarted", plan.message))
                later.append(self._stop_ranks(job, plan.message))
            elif plan.action == "adopt":
                assert plan.base is not None
                live = adopted[job.id] = self.live[job.id] = _Live(
                    tp.ranks_of(job.nodes, time.monotonic()), plan.base, plan.name
                )
                done = self.root / "finetune" / job.id / "adapter.tar"
                if done.is_file():  # renamed into place only once complete and checked: the upload had landed
                    live.uploaded = await asyncio.to_thread(sha256_file, done)
                await self._save(tp.add_event(job, "The scheduler restarted; following the job's ranks again"))
                log.info("fine-tuning job %s adopted: ranks %s", job.id, ", ".join(job.nodes))
            else:
                assert plan.base is not None
                job = await self._save(
                    tp.add_event(job, "The scheduler restarted before the job's ranks ran; starting it again")
                )
                later.append(self._restart(job, plan.base, plan.name))
                log.info("fine-tuning job %s (%s) started again", job.id, job.status)
        return adopted, later

    async def _restart(self, job: FineTuneJob, base: ModelConfig, name: str) -> None:
        """Start again a job the previous scheduler left before its ranks all ran: first stop any rank it had
        started (a worker refuses a job it runs already), then the ordinary start from the staged files."""
        await self._stop_ranks(job, "restarted by a new scheduler")
        if self.jobs[job.id].status not in TERMINAL:  # not cancelled meanwhile
            await self._run(self.jobs[job.id], base, name)

    async def _catch_up(self, job_id: str, live: _Live) -> None:
        """Ask every rank of an adopted job (at once) what it did while no scheduler listened, and apply the
        reports it missed (`training_plan.missed`) as if they had come on time. Runs holding the job's lock,
        taken before this service subscribed, so a live report waits until the gap is replayed. A rank that
        does not answer is not blamed here: the silence rule fails it, naming it, once its grace period ends."""
        try:
            answers = await asyncio.gather(
                *(
                    self.bus.request(
                        CMD_NODE_TRAIN_STATE, TrainStateAsk(job_id=job_id), timeout=STATE_TIMEOUT_S, node_id=r.node_id
                    )
                    for r in live.ranks
                ),
                return_exceptions=True,
            )
            for r, state in zip(live.ranks, answers, strict=True):
                if not isinstance(state, TrainState):
                    log.warning("job %s: rank %d on %s did not say its state: %s", job_id, r.rank, r.node_id, state)
                    continue
                r.last_seen = time.monotonic()
                for rep in tp.missed(self.jobs[job_id], r, state):
                    await self._apply(live, r, rep)
        except Exception:  # the live reports and the silence rule still decide the job
            log.exception("catching up on fine-tuning job %s failed", job_id)
        finally:
            live.lock.release()
        await self._check(job_id)

    # --- records ----------------------------------------------------------------------------------

    async def _save(self, job: FineTuneJob) -> FineTuneJob:
        self.jobs[job.id] = job
        await self.kv.put(job.id, encode(job))
        if job.status in TERMINAL:  # the staged data was for the ranks alone: it goes with the job (the adapter stays)
            await asyncio.to_thread(self._drop_data, job.id)
        return job

    def _drop_data(self, job_id: str) -> None:
        folder = self.root / "finetune" / job_id
        for name in ("train.jsonl", "valid.jsonl", ".train.jsonl.tmp", ".valid.jsonl.tmp"):
            (folder / name).unlink(missing_ok=True)

    def _failed(self, job: FineTuneJob, code: str, message: str) -> FineTuneJob:
        now = time.time()
        job = tp.add_event(job, f"Job failed: {message}", level="error", now=now)
        return msgspec.structs.replace(
            job, status="failed", error=JobError(code=code, message=message), finished_at=int(now)
        )

    # --- create / cancel --------------------------------------------------------------------------

    async def _create(self, req: FineTuneCreate, _m: Msg) -> FineTuneReply:
        base = next((m for m in self.sched.models if m.name == req.model), None)
        if base is None:
            raise BusError("bad_request", f"The model '{req.model}' does not exist.", param="model")
        tp.check_base(base)
        tp.check_suffix(req.suffix)
        name = tp.finetuned_name(base.name, req.suffix, req.job_id)
        taken = {m.name for m in self.sched.models} | {live.name for live in self.live.values()}
        taken |= {tp.finetuned_name(j.model, j.suffix, j.id) for j in self.jobs.values() if j.status not in TERMINAL}
        if name in taken:
            raise BusError(
                "bad_request", f"A model named '{name}' exists already; choose another suffix.", param="suffix"
            )
        file = await self._file(req.training_file, "training_file")
        valid = await self._file(req.validation_file, "validation_file") if req.validation_file else None
        eligible = tp.eligible_nodes(self.sched.nodes, base, req.method)
        holders = {n for n, hb in self.sched.nodes.items() if any(e.model == base.name for e in hb.engines)}
        nodes = tp.choose_ranks(eligible, req.nodes, holders)
        now = time.time()
        job = FineTuneJob(
            id=req.job_id,
            model=base.name,
            training_file=file.id,
            validation_file=valid.id if valid else None,
            suffix=req.suffix,
            method=req.method,
            lora_rank=req.lora_rank,
            lora_alpha=req.lora_alpha,
            seed=req.seed,
            hyperparameters=req.hyperparameters,
            status="validating_files",
            created_at=int(now),
            updated_at=now,
            nodes=nodes,
            key_name=req.key_name,
        )
        job = tp.add_event(job, f"Created fine-tuning job {job.id} ({req.method}, {len(nodes)} node(s))", now=now)
        await self._save(job)
        self._spawn(self._run(job, base, name))
        return FineTuneReply(job=job)

    async def _file(self, file_id: str, param: str) -> FileRecord:
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.kv.get(file_id) if file_id.startswith("file-") else None
        except KeyNotFoundError:
            entry = None
        return tp.check_file(
            decode(entry.value, FileRecord) if entry is not None and entry.value else None, file_id, param
        )

    async def _cancel(self, req: FineTuneCancel, _m: Msg | None) -> FineTuneReply:
        job = self.jobs.get(req.job_id) or await self.read_job(req.job_id)
        if job is None:
            raise BusError("not_found", f"No fine-tuning job '{req.job_id}'.", param="fine_tuning_job_id")
        if job.status in TERMINAL:
            raise BusError("bad_request", f"Job {job.id} is {job.status} already.", param="fine_tuning_job_id")
        job = tp.add_event(
            msgspec.structs.replace(job, status="cancelled", finished_at=int(time.time())), "Job cancelled"
        )
        await self._save(job)
        await self._stop_ranks(job, "cancelled")
        return FineTuneReply(job=job)

    async def read_job(self, job_id: str) -> FineTuneJob | None:
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
                await self.bus.request(
                    CMD_NODE_TRAIN_STOP, TrainStop(job_id=job.id, reason=reason), timeout=10.0, node_id=node
                )
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
            job = await self._save(
                tp.add_event(
                    msgspec.structs.replace(self.jobs[job.id], status="queued"),
                    "Training and validation files checked and staged"
                    if valid_path
                    else "Training file checked and staged",
                )
            )
            live = self.live[job.id] = _Live(tp.ranks_of(job.nodes, time.monotonic()), base, name)
            spec = TrainSpec(
                job_id=job.id,
                rank=0,
                world_size=len(job.nodes),
                base_path=tp.train_path(base),
                data_store_path=data_path,
                valid_store_path=valid_path,
                adapter_store_path=f"finetune/{job.id}/adapter.tar",
                method=job.method,
                lora_rank=job.lora_rank,
                lora_alpha=job.lora_alpha,
                seed=job.seed,
                hyperparameters=job.hyperparameters,
            )
            first = await self._start_rank(job, spec, live)
            if first is None:
                return
            for rank in range(1, len(job.nodes)):
                got = await self._start_rank(
                    job,
                    msgspec.structs.replace(
                        spec, rank=rank, master_addr=first.master_addr, master_port=first.master_port
                    ),
                    live,
                )
                if got is None:
                    return
            if self.jobs[job.id].status in TERMINAL:  # cancelled while its ranks were starting
                await self._stop_ranks(self.jobs[job.id], "cancelled")
                return
            where = ", ".join(f"{n} (rank {i})" for i, n in enumerate(job.nodes))
            said = f"Training on {where}; rendezvous at {first.master_addr}:{first.master_port}"
            job = await self._save(tp.add_event(msgspec.structs.replace(self.jobs[job.id], status="running"), said))
        except Exception as exc:  # the outermost edge of a job's start: fail it, typed
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
        """The uploaded file into the head's model store (temp name, then rename), where nodes fetch it. A copy
        already there (a job started again after a restart) is complete: it was renamed into place."""
        dest = self.root / store_path
        if dest.is_file():
            return
        obs = await self.bus.object_store(FILES)
        data = (await obs.get(file_id)).data
        private_dirs(self.root, dest.parent)
        tmp = dest.with_name(f".{dest.name}.tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as fh:  # a tenant's data
            fh.write(data)
        os.replace(tmp, dest)

    async def _on_report(self, rep: TrainReport, _m: Msg) -> None:
        live = self.live.get(rep.job_id)
        job = self.jobs.get(rep.job_id)
        if live is None or job is None or job.status in TERMINAL or not 0 <= rep.rank < len(live.ranks):
            return
        r = live.ranks[rep.rank]
        if r.node_id != rep.node_id:
            log.warning(
                "job %s: a report for rank %d came from %s, not %s", rep.job_id, rep.rank, rep.node_id, r.node_id
            )
            return
        r.last_seen = time.monotonic()
        async with live.lock:
            await self._apply(live, r, rep)
        await self._check(rep.job_id)

    async def _apply(self, live: _Live, r: tp.Rank, rep: TrainReport) -> None:
        """One report of rank `r` into the job's record and live state (the caller holds `live.lock`). A step
        already recorded (a live report the catch-up also handed over) is not recorded twice."""
        job = self.jobs[rep.job_id]
        if job.status in TERMINAL or self.live.get(rep.job_id) is not live:
            return
        if rep.kind == "step":
            if rep.step <= tp.last_step(job):
                return
            said, data = tp.step_event(
                rep.step, rep.total_steps, rep.loss or 0.0, rep.tokens_per_s or 0.0, rep.trained_tokens, rep.valid_loss
            )
            job = tp.add_event(job, said, type_="metrics", data=data)
            valid = rep.valid_loss if rep.valid_loss is not None else job.valid_loss
            await self._save(msgspec.structs.replace(job, trained_tokens=rep.trained_tokens, valid_loss=valid))
        elif rep.kind == "done" and not r.done:
            r.done, r.digest = True, rep.digest
            said = f"Rank {rep.rank} on {rep.node_id} finished (adapter {rep.digest[:12]})"
            await self._save(tp.add_event(job, said))
        elif rep.kind == "failed":
            r.failed, r.peer, r.failed_at = rep.message or "failed", rep.peer, time.monotonic()

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
        keys_checked = time.monotonic()
        while True:
            await asyncio.sleep(MONITOR_EVERY_S)
            for job_id in list(self.live):
                try:
                    await self._check(job_id)
                except Exception as exc:  # checked again on the next tick
                    log.warning("checking fine-tuning job %s failed: %s", job_id, exc)
            if time.monotonic() - keys_checked >= KEYS_EVERY_S:
                keys_checked = time.monotonic()
                await self._stop_revoked()

    async def _stop_revoked(self) -> None:
        """A job whose key was revoked is cancelled, as its owner would: the key journal (`coderai_keys`, written at
        every revocation by the admin API and `coderai keys revoke`) is asked after the key of each running job."""
        journal = KeyJournal(self.bus)
        for job in [j for j in self.jobs.values() if j.status not in TERMINAL and j.key_name]:
            try:
                rec = await journal.by_name(job.key_name)
            except Exception as exc:  # asked again at the next round
                log.debug("cannot read key %s from the journal: %s", job.key_name, exc)
                continue
            if rec is None or not rec.revoked:
                continue
            log.info("fine-tuning job %s: key %s was revoked; cancelling it", job.id, job.key_name)
            with contextlib.suppress(BusError):
                await self._cancel(FineTuneCancel(job_id=job.id), None)

    async def _succeed(self, job_id: str) -> None:
        live = self.live.pop(job_id, None)
        job = self.jobs[job_id]
        if live is None or job.status in TERMINAL:
            return
        base, name = live.base, live.name
        store_path = f"finetune/{job_id}/adapter.tar"
        base_bytes = _folder_bytes(Path(os.path.expanduser(base.path)))
        cfg = tp.finetuned_config(
            base, name, str(self.root / store_path), store_path, int(time.time()), base_bytes, owner=job.key_name
        )
        try:  # the one add-model path, as `models add` uses: served now, and in the models file for a restart
            await self.sched.live_models.add(cfg, replace=False)
        except BusError as exc:  # the models file cannot take it: served until the scheduler restarts
            if exc.code == "conflict":  # a model of that name came meanwhile: it is never replaced by a tenant's
                await self._fail(
                    job_id,
                    "model_exists",
                    f"A model named '{name}' was added while the job ran; the adapter is kept, the model is not served",
                )
                return
            await self.sched.live_models.publish({cfg.name: cfg})
            log.warning("fine-tuning job %s: could not add %s to the models file: %s", job.id, cfg.name, exc.message)
            job = tp.add_event(
                job,
                f"Serving {cfg.name} until the scheduler restarts: the models file could not "
                f"be updated ({exc.message})",
                level="warn",
            )
        now = time.time()
        job = msgspec.structs.replace(job, status="succeeded", fine_tuned_model=name, finished_at=int(now))
        await self._save(tp.add_event(job, f"New fine-tuned model created: {name}", now=now))
        log.info("fine-tuning job %s succeeded: serving %s", job_id, name)

    # --- the adapter upload -----------------------------------------------------------------------

    async def _upload(self, chunk: AdapterChunk, _m: Msg) -> AdapterAck:
        """Rank 0 appends the adapter tar chunk by chunk; the last one names size and sha256, and only a file that
        matches both is renamed to its final name. Writes for jobs not running here are refused."""
        live = self.live.get(chunk.job_id)
        if live is None:
            raise BusError("bad_request", f"job {chunk.job_id} is not running: no upload taken")
        if not live.ranks or live.ranks[0].node_id != chunk.node_id:  # the subject (NATS rights) names the sender
            log.warning("job %s: an adapter upload from %s, which is not rank 0; refused", chunk.job_id, chunk.node_id)
            raise BusError("forbidden", f"only rank 0 of job {chunk.job_id} uploads its adapter")
        folder = self.root / "finetune" / chunk.job_id
        partial = folder / ".adapter.tar.partial"
        have = partial.stat().st_size if partial.exists() else 0
        if chunk.offset == 0:
            have = 0
            partial.unlink(missing_ok=True)
        if chunk.offset != have:
            raise BusError("bad_request", f"upload out of order: offset {chunk.offset}, have {have} bytes")
        private_dirs(self.root, folder)
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as fh:  # chunks of 512 KB
            fh.write(chunk.data)
        have += len(chunk.data)
        if not chunk.sha256:
            return AdapterAck(received=have)
        got = await asyncio.to_thread(sha256_file, partial)
        if have != chunk.size or got != chunk.sha256:
            partial.unlink(missing_ok=True)
            raise BusError(
                "bad_request",
                f"adapter upload corrupted: {have} bytes sha256 {got[:12]}, "
                f"expected {chunk.size} bytes sha256 {chunk.sha256[:12]}",
            )
        os.replace(partial, folder / "adapter.tar")
        live.uploaded = got
        async with live.lock:
            await self._save(tp.add_event(self.jobs[chunk.job_id], f"Adapter stored ({have} bytes)"))
        self._spawn(self._check(chunk.job_id))
        return AdapterAck(received=have, complete=True)


def private_dirs(root: Path, folder: Path) -> None:
    """Make `folder` (under `root`) and the folders between them, each 0700: what a tenant trained on or made is
    not for the machine's other users."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    parts = folder.relative_to(root).parts
    for i in range(1, len(parts) + 1):
        os.chmod(root.joinpath(*parts[:i]), 0o700)


def _folder_bytes(folder: Path) -> int:
    try:
        if folder.is_file():  # a GGUF base
            return folder.stat().st_size
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    except OSError:
        return 0
