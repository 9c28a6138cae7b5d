"""OpenAI's fine-tuning API, `/v1/fine_tuning/jobs` (create, list, retrieve, events, cancel), in OpenAI's
response shapes, so the official SDK works against it.

Job records are written by the scheduler, which runs the jobs, and read here from the `coderai_finetune` bucket
(`files.py`), so any replica answers. coderai's extensions to a job: `method`
"lora" or "qlora" (OpenAI's `{"type": "supervised", ...}` object means LoRA), `nodes`, `lora_rank`, `lora_alpha`.
"""

from __future__ import annotations

import secrets
from typing import Any, TypeVar, cast

import msgspec
from litestar import Request, Response, get, post
from litestar.params import FromPath

from coderai.contracts import BusError
from coderai.contracts.subject import Subject
from coderai.contracts.subjects import CMD_SCHEDULER_TRAIN, CMD_SCHEDULER_TRAIN_CANCEL
from coderai.contracts.training import (
    Batching,
    FineTuneCancel,
    FineTuneCreate,
    FineTuneJob,
    FineTuneReply,
    Hyperparameters,
    TrainOn,
)
from coderai.gateway.accounting import allowed
from coderai.gateway.errors import ApiError, from_bus
from coderai.gateway.http import json_response, query_int, read_json
from coderai.gateway.openai.files import Records, mine, page
from coderai.gateway.state import Gateway, InferenceController


N = TypeVar("N", int, float)
M = TypeVar("M", FineTuneCreate, FineTuneCancel)


class JobRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/fine_tuning/jobs`, lenient on fields it does not use (integrations, metadata)."""

    model: str
    training_file: str
    hyperparameters: dict[str, Any] | None = None
    suffix: str | None = None
    seed: int | None = None
    method: str | dict[str, Any] | None = None
    validation_file: str | None = None
    nodes: int = 0
    lora_rank: int = 8
    lora_alpha: int = 16


def _bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _number(hp: dict[str, Any], name: str, kind: type[N], lo: float, hi: float, auto: N) -> N:
    value = hp.get(name, "auto")
    if value is None or value == "auto":
        return auto
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise _bad(f'hyperparameters.{name} must be "auto" or a number.', f"hyperparameters.{name}")
    if not lo <= value <= hi:
        raise _bad(f"hyperparameters.{name} must be between {lo:g} and {hi:g}.", f"hyperparameters.{name}")
    return kind(value)


def resolve(req: JobRequest, job_id: str, key_name: str = "") -> FineTuneCreate:
    """The scheduler's request from an API request: `method` and hyperparameters resolved ("auto" -> defaults),
    every range checked (ApiError 400 naming the field)."""
    hp = dict(req.hyperparameters or {})
    method = "lora"
    if isinstance(req.method, str):
        method = req.method
    elif isinstance(req.method, dict):
        kind = req.method.get("type", "supervised")
        if kind in ("lora", "qlora"):
            method = kind
        elif kind != "supervised":
            raise _bad(
                f'method type {kind!r} is not supported; use "supervised" (or coderai\'s "lora", "qlora").',
                "method",
                "unsupported_method",
            )
        inner = req.method.get(kind) or {}
        if not isinstance(inner, dict):
            raise _bad(f"method.{kind} must be an object.", f"method.{kind}")
        extra = inner.get("hyperparameters") or {}
        if not isinstance(extra, dict):
            raise _bad(f"method.{kind}.hyperparameters must be an object.", f"method.{kind}.hyperparameters")
        hp = {**hp, **extra}
    if method not in ("lora", "qlora"):
        raise _bad(f'method must be "lora" or "qlora", not {method!r}.', "method", "unsupported_method")
    unknown = set(hp) - {"n_epochs", "batch_size", "learning_rate_multiplier", "max_seq_len", "train_on", "batching"}
    if unknown:
        raise _bad(f"unknown hyperparameters {sorted(unknown)}.", "hyperparameters")
    for name, lo, hi in (("nodes", 0, 64), ("lora_rank", 1, 256), ("lora_alpha", 1, 1024)):
        if not lo <= getattr(req, name) <= hi:
            raise _bad(f"{name} must be between {lo} and {hi}.", name)
    return FineTuneCreate(
        job_id=job_id,
        model=req.model,
        training_file=req.training_file,
        validation_file=req.validation_file or None,
        suffix=req.suffix or "",
        method=method,
        nodes=req.nodes,
        lora_rank=req.lora_rank,
        lora_alpha=req.lora_alpha,
        seed=req.seed if req.seed is not None else 42,
        key_name=key_name,
        hyperparameters=Hyperparameters(
            n_epochs=_number(hp, "n_epochs", int, 1, 100, 3),
            batch_size=_number(hp, "batch_size", int, 1, 256, 1),
            learning_rate_multiplier=_number(hp, "learning_rate_multiplier", float, 1e-4, 1000, 1.0),
            max_seq_len=_number(hp, "max_seq_len", int, 0, 1 << 20, 0),
            train_on=_train_on(hp.get("train_on", "auto")),
            batching=_batching(hp.get("batching", "auto")),
        ),
    )


def _train_on(value: object) -> TrainOn:
    return "all" if _one_of(value, "train_on", "assistant", "all") == "all" else "assistant"


def _batching(value: object) -> Batching:
    return cast(Batching, _one_of(value, "batching", "bucket", "shuffle", "pack"))


def _one_of(value: object, name: str, default: str, *others: str) -> str:
    """`default` for "auto" or itself, each of `others` for itself; else a 400 naming `hyperparameters.<name>`."""
    if value in ("auto", default):
        return default
    if value in others:
        return str(value)
    *rest, last = others
    listed = "".join(f', "{o}"' for o in rest)
    raise _bad(
        f'hyperparameters.{name} must be "{default}" (the default){listed} or "{last}".', f"hyperparameters.{name}"
    )


def job_json(job: FineTuneJob) -> dict[str, Any]:
    """OpenAI's `fine_tuning.job`, plus coderai's `method` extension fields under `coderai` (and there the last
    validation loss, `valid_loss`, when the job has a validation file)."""
    hp = {
        "n_epochs": job.hyperparameters.n_epochs,
        "batch_size": job.hyperparameters.batch_size,
        "learning_rate_multiplier": job.hyperparameters.learning_rate_multiplier,
        "max_seq_len": job.hyperparameters.max_seq_len,
        "train_on": job.hyperparameters.train_on,
        "batching": job.hyperparameters.batching,
    }
    return {
        "object": "fine_tuning.job",
        "id": job.id,
        "model": job.model,
        "created_at": job.created_at,
        "finished_at": job.finished_at,
        "fine_tuned_model": job.fine_tuned_model,
        "organization_id": "coderai",
        "result_files": [],
        "status": job.status,
        "validation_file": job.validation_file,
        "training_file": job.training_file,
        "hyperparameters": hp,
        "trained_tokens": job.trained_tokens,
        "seed": job.seed,
        "estimated_finish": None,
        "integrations": [],
        "user_provided_suffix": job.suffix or None,
        "metadata": None,
        "error": (
            {"code": job.error.code, "message": job.error.message, "param": job.error.param} if job.error else None
        ),
        "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
        "coderai": {
            "method": job.method,
            "nodes": job.nodes,
            "lora_rank": job.lora_rank,
            "lora_alpha": job.lora_alpha,
            "valid_loss": job.valid_loss,
        },
    }


def events_page(job: FineTuneJob, after: str | None, limit: int) -> dict[str, Any]:
    """Events newest first, those older than `after` (an event id) when given, `limit` of them."""
    events = list(reversed(job.events))
    if after:
        ids = [e.id for e in events]
        events = events[ids.index(after) + 1 :] if after in ids else []
    page = events[:limit]
    data = [
        {
            "object": "fine_tuning.job.event",
            "id": e.id,
            "created_at": e.created_at,
            "level": e.level,
            "message": e.message,
            "type": e.type,
            "data": e.data or None,
        }
        for e in page
    ]
    return {"object": "list", "data": data, "has_more": len(events) > limit}


class FineTuningController(InferenceController):
    path = "/v1/fine_tuning/jobs"
    records: Records

    @post("/", status_code=200)
    async def create(self, request: Request) -> Response:
        who = self.caller(request)
        req = await read_json(request, JobRequest)
        allowed(who, req.model)  # the key's model allow-list, rates and budget, as on every call
        await self.gw.accounts.admit(who, None)
        for param, file_id in (("training_file", req.training_file), ("validation_file", req.validation_file)):
            if file_id:  # a key trains only on its own files; another key's is as unknown as one that never was
                try:
                    await self.records.own_file(who, file_id, param)
                except ApiError:
                    raise ApiError(
                        400,
                        f"{param} {file_id!r} is not one of your files (upload it with purpose=fine-tune).",
                        param=param,
                        code="invalid_file",
                    ) from None
        msg = resolve(req, "ftjob-" + secrets.token_hex(12), who.key_name)
        return json_response(job_json(await _ask(self.gw, CMD_SCHEDULER_TRAIN, msg)))

    @get("/")
    async def list_jobs(self, request: Request) -> Response:
        who = self.caller(request)
        jobs = [j for j in await self.records.all("ftjob-", FineTuneJob) if mine(who, j.key_name)]
        jobs, more = page(jobs, request.query_params.get("after"), query_int(request, "limit", 20, 1, 100))
        return json_response({"object": "list", "data": [job_json(j) for j in jobs], "has_more": more})

    @get("/{job_id:str}")
    async def retrieve(self, request: Request, job_id: FromPath[str]) -> Response:
        who = self.caller(request)
        return json_response(job_json(await self.records.own_job(who, job_id)))

    @get("/{job_id:str}/events")
    async def events(self, request: Request, job_id: FromPath[str]) -> Response:
        who = self.caller(request)
        job = await self.records.own_job(who, job_id)
        return json_response(
            events_page(job, request.query_params.get("after"), query_int(request, "limit", 20, 1, 100))
        )

    @post("/{job_id:str}/cancel", status_code=200)
    async def cancel(self, request: Request, job_id: FromPath[str]) -> Response:
        who = self.caller(request)
        await self.records.own_job(who, job_id)  # 404 for an unknown id or another key's, from any replica
        return json_response(job_json(await _ask(self.gw, CMD_SCHEDULER_TRAIN_CANCEL, FineTuneCancel(job_id=job_id))))


async def _ask(gw: Gateway, subject: Subject[M, FineTuneReply], msg: M) -> FineTuneJob:
    try:
        reply = await gw.bus.request(subject, msg, timeout=30.0)
    except BusError as exc:
        raise from_bus(exc, gw.settings.retry_after_s) from None
    return reply.job
