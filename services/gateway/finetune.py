"""OpenAI's files and fine-tuning API: `/v1/files` (upload, list, retrieve, content, delete),
`/v1/fine_tuning/jobs` (create, list, retrieve, events, cancel), in OpenAI's response shapes, so the official SDK works against it.

Stateless like the rest of the gateway: file bytes go into the `coderai_files` object store and file records into
the `coderai_finetune` KV bucket (this gateway writes them); job records are written by the scheduler, which runs
the jobs, and read here from the same bucket, so any replica answers. coderai's extensions to a job: `method`
"lora" or "qlora" (OpenAI's `{"type": "supervised", ...}` object means LoRA), `nodes`, `lora_rank`, `lora_alpha`.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import msgspec
from coderai.contracts import BusError, encode
from coderai.contracts.subjects import CMD_SCHEDULER_TRAIN, CMD_SCHEDULER_TRAIN_CANCEL
from coderai.contracts.topology import FILES, FINETUNE
from coderai.contracts.training import (
    FileRecord,
    FineTuneCancel,
    FineTuneCreate,
    FineTuneJob,
    Hyperparameters,
)
from coderai.gateway import openai_types as oa
from coderai.gateway.errors import ApiError, from_bus
from coderai.gateway.media_types import read_form
from coderai.training_data import BadTrainingFile, parse_examples
from litestar import Request, Response, delete, get, post
from litestar.params import FromPath

JSON = "application/json"
PURPOSES = ("fine-tune", "assistants", "batch", "user_data", "vision", "evals")


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


def _number(hp: dict[str, Any], name: str, kind: type, lo: float, hi: float, auto: Any) -> Any:
    value = hp.get(name, "auto")
    if value is None or value == "auto":
        return auto
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise _bad(f"hyperparameters.{name} must be \"auto\" or a number.", f"hyperparameters.{name}")
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
            raise _bad(f"method type {kind!r} is not supported; use \"supervised\" (or coderai's \"lora\", \"qlora\").",
                       "method", "unsupported_method")
        hp = {**hp, **((req.method.get(kind) or {}).get("hyperparameters") or {})}
    if method not in ("lora", "qlora"):
        raise _bad(f"method must be \"lora\" or \"qlora\", not {method!r}.", "method", "unsupported_method")
    unknown = set(hp) - {"n_epochs", "batch_size", "learning_rate_multiplier"}
    if unknown:
        raise _bad(f"unknown hyperparameters {sorted(unknown)}.", "hyperparameters")
    for name, lo, hi in (("nodes", 0, 64), ("lora_rank", 1, 256), ("lora_alpha", 1, 1024)):
        if not lo <= getattr(req, name) <= hi:
            raise _bad(f"{name} must be between {lo} and {hi}.", name)
    return FineTuneCreate(
        job_id=job_id, model=req.model, training_file=req.training_file, validation_file=req.validation_file or None,
        suffix=req.suffix or "",
        method=method, nodes=req.nodes, lora_rank=req.lora_rank, lora_alpha=req.lora_alpha,  # type: ignore[arg-type]
        seed=req.seed if req.seed is not None else 42, key_name=key_name,
        hyperparameters=Hyperparameters(
            n_epochs=_number(hp, "n_epochs", int, 1, 100, 3),
            batch_size=_number(hp, "batch_size", int, 1, 256, 1),
            learning_rate_multiplier=_number(hp, "learning_rate_multiplier", float, 1e-4, 1000, 1.0),
        ),
    )


def file_json(rec: FileRecord) -> dict[str, Any]:
    return {"object": "file", "id": rec.id, "bytes": rec.bytes, "created_at": rec.created_at, "filename": rec.filename,
            "purpose": rec.purpose, "status": "processed", "status_details": None, "expires_at": None}


def job_json(job: FineTuneJob) -> dict[str, Any]:
    """OpenAI's `fine_tuning.job`, plus coderai's `method` extension fields under `coderai` (and there the last
    validation loss, `valid_loss`, when the job has a validation file)."""
    hp = {"n_epochs": job.hyperparameters.n_epochs, "batch_size": job.hyperparameters.batch_size,
          "learning_rate_multiplier": job.hyperparameters.learning_rate_multiplier}
    return {
        "object": "fine_tuning.job", "id": job.id, "model": job.model, "created_at": job.created_at,
        "finished_at": job.finished_at, "fine_tuned_model": job.fine_tuned_model, "organization_id": "coderai",
        "result_files": [], "status": job.status, "validation_file": job.validation_file,
        "training_file": job.training_file,
        "hyperparameters": hp, "trained_tokens": job.trained_tokens, "seed": job.seed, "estimated_finish": None,
        "integrations": [], "user_provided_suffix": job.suffix or None, "metadata": None,
        "error": ({"code": job.error.code, "message": job.error.message, "param": job.error.param}
                  if job.error else None),
        "method": {"type": "supervised", "supervised": {"hyperparameters": hp}},
        "coderai": {"method": job.method, "nodes": job.nodes, "lora_rank": job.lora_rank, "lora_alpha": job.lora_alpha,
                    "valid_loss": job.valid_loss},
    }


def events_page(job: FineTuneJob, after: str | None, limit: int) -> dict[str, Any]:
    """Events newest first, those older than `after` (an event id) when given, `limit` of them."""
    events = list(reversed(job.events))
    if after:
        ids = [e.id for e in events]
        events = events[ids.index(after) + 1:] if after in ids else []
    page = events[:limit]
    data = [{"object": "fine_tuning.job.event", "id": e.id, "created_at": e.created_at, "level": e.level,
             "message": e.message, "type": e.type, "data": e.data or None} for e in page]
    return {"object": "list", "data": data, "has_more": len(events) > limit}


def _limit(request: Request, default: int = 20, most: int = 100) -> int:
    raw = request.query_params.get("limit", str(default))
    try:
        n = int(raw)
    except ValueError:
        raise _bad(f"limit must be a whole number, not {raw!r}.", "limit") from None
    if not 1 <= n <= most:
        raise _bad(f"limit must be between 1 and {most}.", "limit")
    return n


def finetune_routes(gw: Any, caller: Any) -> list:
    handles: dict[str, Any] = {}  # bound once per process

    async def kv() -> Any:
        if "kv" not in handles:
            handles["kv"] = await gw.bus.kv(FINETUNE)
        return handles["kv"]

    async def files() -> Any:
        if "obs" not in handles:
            from nats.js.api import ObjectStoreConfig
            from nats.js.errors import BucketNotFoundError, NotFoundError

            try:
                handles["obs"] = await gw.bus.js.object_store(FILES.name)
            except (BucketNotFoundError, NotFoundError):
                cfg = ObjectStoreConfig(bucket=FILES.name, description=FILES.description,
                                        max_bytes=gw.settings.files_max_bytes or None)
                handles["obs"] = await gw.bus.js.create_object_store(FILES.name, config=cfg)
        return handles["obs"]

    async def record(key: str, prefix: str, what: str, param: str) -> bytes:
        from nats.js.errors import KeyNotFoundError

        if not key.startswith(prefix) or not key[len(prefix):].isalnum():
            raise ApiError(404, f"No {what} '{key}'.", param=param, code="not_found")
        try:
            entry = await (await kv()).get(key)
        except KeyNotFoundError:
            entry = None
        if entry is None or not entry.value:
            raise ApiError(404, f"No {what} '{key}'.", param=param, code="not_found")
        return entry.value

    async def all_records(prefix: str, kind: type) -> list[Any]:
        """Every record whose key starts with `prefix`, newest first."""
        bucket = await kv()
        try:
            keys = [k for k in await bucket.keys() if k.startswith(prefix)]
        except Exception:  # noqa: BLE001 - nats-py raises NoKeysError on an empty bucket
            keys = []
        out = []
        for k in keys:
            try:
                out.append(msgspec.json.decode((await bucket.get(k)).value, type=kind))
            except Exception:  # noqa: BLE001 - deleted between keys() and get()
                continue
        out.sort(key=lambda r: (r.created_at, r.id), reverse=True)
        return out

    def page(items: list[Any], after: str | None, limit: int) -> tuple[list[Any], bool]:
        if after:
            ids = [x.id for x in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        return items[:limit], len(items) > limit

    async def load_job(job_id: str) -> FineTuneJob:
        data = await record(job_id, "ftjob-", "fine-tuning job", "fine_tuning_job_id")
        return msgspec.json.decode(data, type=FineTuneJob)

    def mine(who: Any, owner: str) -> bool:
        """What a key may see: its own files and jobs; an admin key sees every one."""
        return "admin" in who.scopes or owner == who.key_name

    async def own_file(who: Any, file_id: str, param: str = "file_id") -> FileRecord:
        """The caller's file, else the 404 an unknown id gets (another key's file is not said to exist)."""
        rec = msgspec.json.decode(await record(file_id, "file-", "file", param), type=FileRecord)
        if not mine(who, rec.owner):
            raise ApiError(404, f"No file '{file_id}'.", param=param, code="not_found")
        return rec

    async def own_job(who: Any, job_id: str) -> FineTuneJob:
        job = await load_job(job_id)
        if not mine(who, job.key_name):
            raise ApiError(404, f"No fine-tuning job '{job_id}'.", param="fine_tuning_job_id", code="not_found")
        return job

    def json(obj: Any, status: int = 200) -> Response:
        return Response(content=msgspec.json.encode(obj), media_type=JSON, status_code=status)

    async def ask(subject: Any, msg: Any) -> FineTuneJob:
        try:
            reply = await gw.bus.request(subject, msg, timeout=30.0)
        except BusError as exc:
            raise from_bus(exc, gw.settings.retry_after_s) from None
        return reply.job

    @post("/v1/files", status_code=200, request_max_body_size=gw.settings.max_upload_bytes + 1024 * 1024)
    async def upload(request: Request) -> Response:
        """A file in OpenAI's shape; `fine-tune` files are checked line by line before they are kept."""
        who = await caller(request)
        await gw.admit(who, None, None)  # rates and a spent budget, as on every call
        form = await read_form(request, gw.settings.max_upload_bytes)
        purpose = form.require("purpose")
        if purpose not in PURPOSES:
            raise _bad(f"purpose must be one of {', '.join(PURPOSES)}.", "purpose")
        up = form.files.get("file")
        if up is None:
            raise ApiError(400, "Upload a file in the multipart field 'file'.", param="file", code="missing_file")
        examples = 0
        if purpose == "fine-tune":
            try:
                examples = len(parse_examples(up.data))
            except BadTrainingFile as exc:
                named = f" {up.filename}" if up.filename else ""
                raise ApiError(400, f"Invalid fine-tuning file{named}: {exc}", param="file",
                               code="invalid_file_format") from None
        quota = gw.settings.file_quota_bytes
        if quota:
            kept = sum(r.bytes for r in await all_records("file-", FileRecord) if r.owner == who.key_name)
            if kept + len(up.data) > quota:
                raise ApiError(429, f"This key keeps {kept} bytes of files; {len(up.data)} more would pass its quota of "
                                    f"{quota} bytes. Delete files it no longer needs.", type="insufficient_quota",
                               param="file", code="file_quota_exceeded")
        rec = FileRecord(id="file-" + secrets.token_hex(12), bytes=len(up.data), created_at=int(time.time()),
                         filename=up.filename or "upload.jsonl", purpose=purpose, examples=examples,
                         owner=who.key_name)
        await (await files()).put(rec.id, up.data)
        await (await kv()).put(rec.id, encode(rec))
        return json(file_json(rec))

    @get("/v1/files")
    async def list_files(request: Request) -> Response:
        """Uploaded files, newest first (`order=asc` for oldest first), by `purpose`, paged by `after`/`limit`."""
        who = await caller(request)
        q = request.query_params
        limit = _limit(request, default=10000, most=10000)
        recs = [r for r in await all_records("file-", FileRecord)
                if mine(who, r.owner) and (not q.get("purpose") or r.purpose == q["purpose"])]
        if q.get("order", "desc") == "asc":
            recs.reverse()
        data, more = page(recs, q.get("after"), limit)
        return json({"object": "list", "data": [file_json(r) for r in data], "has_more": more,
                     "first_id": data[0].id if data else None, "last_id": data[-1].id if data else None})

    @get("/v1/files/{file_id:str}")
    async def get_file(request: Request, file_id: FromPath[str]) -> Response:
        return json(file_json(await own_file(await caller(request), file_id)))

    @get("/v1/files/{file_id:str}/content")
    async def file_content(request: Request, file_id: FromPath[str]) -> Response:
        rec = await own_file(await caller(request), file_id)
        data = (await (await files()).get(rec.id)).data or b""
        return Response(content=data, media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{rec.filename}"'})

    @delete("/v1/files/{file_id:str}", status_code=200)
    async def delete_file(request: Request, file_id: FromPath[str]) -> Response:
        """Forget a file (its bytes and its record); jobs that already read it keep what they read."""
        from nats.js.errors import NotFoundError

        await own_file(await caller(request), file_id)
        try:
            await (await files()).delete(file_id)
        except NotFoundError:
            pass
        await (await kv()).delete(file_id)
        return json({"id": file_id, "object": "file", "deleted": True})

    @post("/v1/fine_tuning/jobs", status_code=200)
    async def create(request: Request) -> Response:
        who = await caller(request)
        req = oa.parse(await request.body(), JobRequest)
        key = who.key  # the key's model allow-list, rates and budget, as on every call
        if key is not None and key.models and req.model not in key.models:
            raise ApiError(403, f"This key may not use the model '{req.model}'.", param="model", code="model_not_allowed")
        await gw.admit(who, None, None)
        for param, file_id in (("training_file", req.training_file), ("validation_file", req.validation_file)):
            if file_id:  # a key trains only on its own files; another key's is as unknown as one that never was
                try:
                    await own_file(who, file_id, param)
                except ApiError as exc:
                    raise ApiError(400, f"{param} {file_id!r} is not one of your files (upload it with "
                                        "purpose=fine-tune).", param=param, code="invalid_file") from None
        msg = resolve(req, "ftjob-" + secrets.token_hex(12), who.key_name)
        return json(job_json(await ask(CMD_SCHEDULER_TRAIN, msg)))

    @get("/v1/fine_tuning/jobs")
    async def list_jobs(request: Request) -> Response:
        who = await caller(request)
        jobs = [j for j in await all_records("ftjob-", FineTuneJob) if mine(who, j.key_name)]
        jobs, more = page(jobs, request.query_params.get("after"), _limit(request))
        return json({"object": "list", "data": [job_json(j) for j in jobs], "has_more": more})

    @get("/v1/fine_tuning/jobs/{job_id:str}")
    async def retrieve(request: Request, job_id: FromPath[str]) -> Response:
        return json(job_json(await own_job(await caller(request), job_id)))

    @get("/v1/fine_tuning/jobs/{job_id:str}/events")
    async def events(request: Request, job_id: FromPath[str]) -> Response:
        job = await own_job(await caller(request), job_id)
        return json(events_page(job, request.query_params.get("after"), _limit(request)))

    @post("/v1/fine_tuning/jobs/{job_id:str}/cancel", status_code=200)
    async def cancel(request: Request, job_id: FromPath[str]) -> Response:
        await own_job(await caller(request), job_id)  # 404 for an unknown id or another key's, from any replica
        return json(job_json(await ask(CMD_SCHEDULER_TRAIN_CANCEL, FineTuneCancel(job_id=job_id))))

    return [upload, list_files, get_file, file_content, delete_file, create, list_jobs, retrieve, events, cancel]
