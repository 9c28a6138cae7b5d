"""OpenAI's files API, `/v1/files` (upload, list, retrieve, content, delete), and the records it shares with
fine-tuning: file bytes in the `coderai_files` object store, file and job records in the `coderai_finetune` KV
bucket. Every record has an owner (the key that made it); another key's is as unknown as one that never was
(an admin key sees every one)."""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import quote

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.params import FromPath
from litestar.response import Stream

from coderai.contracts import encode
from coderai.contracts.topology import FILES, FINETUNE
from coderai.contracts.training import FileRecord, FineTuneJob
from coderai.gateway.auth import Caller
from coderai.gateway.errors import ApiError
from coderai.gateway.http import json_response, query_int
from coderai.gateway.openai.forms import read_form
from coderai.gateway.state import Gateway, InferenceController
from coderai.runtime.kv import read_all
from coderai.runtime.stores import object_chunks
from coderai.training_data import BadTrainingFile, parse_examples

if TYPE_CHECKING:
    from nats.js.kv import KeyValue
    from nats.js.object_store import ObjectStore


class HasId(Protocol):
    """What `page` pages by."""

    @property
    def id(self) -> str: ...


class Dated(HasId, Protocol):
    """A record `Records.all` lists, newest first."""

    @property
    def created_at(self) -> float: ...


T = TypeVar("T")
Item = TypeVar("Item", bound=HasId)
D = TypeVar("D", bound=Dated)
PURPOSES = ("fine-tune", "assistants", "batch", "user_data", "vision", "evals")


def file_json(rec: FileRecord) -> dict[str, Any]:
    return {
        "object": "file",
        "id": rec.id,
        "bytes": rec.bytes,
        "created_at": rec.created_at,
        "filename": rec.filename,
        "purpose": rec.purpose,
        "status": "processed",
    }  # no expiry: OpenAI leaves `expires_at` out then


def mine(who: Caller, owner: str) -> bool:
    """What a key may see: its own files and jobs; an admin key sees every one."""
    return "admin" in who.scopes or owner == who.key_name


def page(items: list[Item], after: str | None, limit: int) -> tuple[list[Item], bool]:
    """The `limit` items after the one with id `after` (from the start without it), and whether more follow."""
    if after:
        ids = [x.id for x in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    return items[:limit], len(items) > limit


class Records:
    """The bucket and the object store, each bound once per process."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._kv: KeyValue | None = None
        self._files: ObjectStore | None = None

    async def kv(self) -> KeyValue:
        kv = self._kv
        if kv is None:
            kv = self._kv = await self.gw.bus.kv(FINETUNE)
        return kv

    async def files(self) -> ObjectStore:
        store = self._files
        if store is None:
            max_bytes = self.gw.settings.files_max_bytes
            store = self._files = await self.gw.bus.object_store(FILES, create=True, max_bytes=max_bytes)
        return store

    async def get(self, key: str, prefix: str, type_: type[T], what: str, param: str) -> T:
        """The record `key` (`prefix` + letters and digits), else a 404 naming `param`."""
        from nats.js.errors import KeyNotFoundError

        missing = ApiError(404, f"No {what} '{key}'.", param=param, code="not_found")
        if not key.startswith(prefix) or not key[len(prefix) :].isalnum():
            raise missing
        try:
            entry = await (await self.kv()).get(key)
        except KeyNotFoundError:
            raise missing from None
        if entry is None or not entry.value:
            raise missing
        return msgspec.json.decode(entry.value, type=type_)

    async def all(self, prefix: str, type_: type[D]) -> list[D]:
        """Every record whose key starts with `prefix`, newest first."""
        out = list((await read_all(await self.kv(), type_, prefix=prefix)).values())
        out.sort(key=lambda r: (r.created_at, r.id), reverse=True)
        return out

    async def own_file(self, who: Caller, file_id: str, param: str = "file_id") -> FileRecord:
        rec = await self.get(file_id, "file-", FileRecord, "file", param)
        if not mine(who, rec.owner):
            raise ApiError(404, f"No file '{file_id}'.", param=param, code="not_found")
        return rec

    async def own_job(self, who: Caller, job_id: str) -> FineTuneJob:
        job = await self.get(job_id, "ftjob-", FineTuneJob, "fine-tuning job", "fine_tuning_job_id")
        if not mine(who, job.key_name):
            raise ApiError(404, f"No fine-tuning job '{job_id}'.", param="fine_tuning_job_id", code="not_found")
        return job


def attachment(filename: str) -> str:
    """A `Content-Disposition` for `filename`, whatever it holds: an ASCII fallback (quotes, backslashes and
    control characters replaced) and, for any other name, RFC 6266's `filename*` in UTF-8."""
    plain = "".join(c if " " <= c < "\x7f" and c not in '"\\' else "_" for c in filename) or "file"
    if plain == filename or not filename:
        return f'attachment; filename="{plain}"'
    return f"attachment; filename=\"{plain}\"; filename*=UTF-8''{quote(filename, safe='')}"


class FilesController(InferenceController):
    path = "/v1/files"
    records: Records

    @post("/", status_code=200)
    async def upload(self, request: Request) -> Response:
        """A file in OpenAI's shape; `fine-tune` files are checked line by line before they are kept."""
        who = self.caller(request)
        await self.gw.accounts.admit(who, None)  # rates and a spent budget, as on every call
        form = await read_form(request, self.gw.settings.max_upload_bytes)
        purpose = form.require("purpose")
        if purpose not in PURPOSES:
            raise ApiError(400, f"purpose must be one of {', '.join(PURPOSES)}.", param="purpose", code="invalid_value")
        up = form.files.get("file")
        if up is None:
            raise ApiError(400, "Upload a file in the multipart field 'file'.", param="file", code="missing_file")
        examples = 0
        if purpose == "fine-tune":
            try:
                examples = len(parse_examples(up.data))
            except BadTrainingFile as exc:
                named = f" {up.filename}" if up.filename else ""
                raise ApiError(
                    400, f"Invalid fine-tuning file{named}: {exc}", param="file", code="invalid_file_format"
                ) from None
        quota, most = self.gw.settings.file_quota_bytes, self.gw.settings.file_quota_count
        if quota or most:
            own = [r.bytes for r in await self.records.all("file-", FileRecord) if r.owner == who.key_name]
            kept = sum(own)
            if quota and kept + len(up.data) > quota:
                raise ApiError(
                    429,
                    f"This key keeps {kept} bytes of files; {len(up.data)} more would pass its quota of "
                    f"{quota} bytes. Delete files it no longer needs.",
                    type="insufficient_quota",
                    param="file",
                    code="file_quota_exceeded",
                )
            if most and len(own) >= most:
                raise ApiError(
                    429,
                    f"This key keeps {len(own)} files, its quota. Delete files it no longer needs.",
                    type="insufficient_quota",
                    param="file",
                    code="file_quota_exceeded",
                )
        rec = FileRecord(
            id="file-" + secrets.token_hex(12),
            bytes=len(up.data),
            created_at=int(time.time()),
            filename=up.filename or "upload.jsonl",
            purpose=purpose,
            examples=examples,
            owner=who.key_name,
        )
        await (await self.records.files()).put(rec.id, up.data)
        await (await self.records.kv()).put(rec.id, encode(rec))
        return json_response(file_json(rec))

    @get("/")
    async def list_files(self, request: Request) -> Response:
        """Uploaded files, newest first (`order=asc` for oldest first), by `purpose`, paged by `after`/`limit`."""
        who = self.caller(request)
        q = request.query_params
        limit = query_int(request, "limit", 10000, 1, 10000)
        recs = [
            r
            for r in await self.records.all("file-", FileRecord)
            if mine(who, r.owner) and (not q.get("purpose") or r.purpose == q["purpose"])
        ]
        if q.get("order", "desc") == "asc":
            recs.reverse()
        data, more = page(recs, q.get("after"), limit)
        return json_response(
            {
                "object": "list",
                "data": [file_json(r) for r in data],
                "has_more": more,
                "first_id": data[0].id if data else None,
                "last_id": data[-1].id if data else None,
            }
        )

    @get("/{file_id:str}")
    async def retrieve(self, request: Request, file_id: FromPath[str]) -> Response:
        who = self.caller(request)
        return json_response(file_json(await self.records.own_file(who, file_id)))

    @get("/{file_id:str}/content")
    async def content(self, request: Request, file_id: FromPath[str]) -> Response:
        who = self.caller(request)
        rec = await self.records.own_file(who, file_id)
        # streamed chunk by chunk from the object store: a 1 GiB file is never whole in the gateway's memory
        size, chunks = await object_chunks(self.gw.bus, FILES, await self.records.files(), rec.id)
        return Stream(
            chunks,
            media_type="application/octet-stream",
            headers={"Content-Disposition": attachment(rec.filename), "Content-Length": str(size)},
        )

    @delete("/{file_id:str}", status_code=200)
    async def remove(self, request: Request, file_id: FromPath[str]) -> Response:
        """Forget a file (its bytes and its record); jobs that already read it keep what they read."""
        who = self.caller(request)
        from nats.js.errors import NotFoundError

        await self.records.own_file(who, file_id)
        try:
            await (await self.records.files()).delete(file_id)
        except NotFoundError:
            pass
        await (await self.records.kv()).delete(file_id)
        return json_response({"id": file_id, "object": "file", "deleted": True})
