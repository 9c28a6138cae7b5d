"""OpenAI's Batches API, `/v1/batches`: a `/v1/files` file (purpose `batch`) of chat completion, embedding or
Responses requests, run line by line on every worker holding the model (`gateway/batches/`). Every batch has an
owner (the key that made it); another key's is as unknown as one that never was (an admin key sees every one)."""

from __future__ import annotations

import secrets
import time

import msgspec
from litestar import Request, Response, get, post
from litestar.params import FromPath
from nats.js.errors import KeyNotFoundError

from coderai.gateway.auth import Caller
from coderai.gateway.batches.records import RUNNING, WINDOWS, BatchRecord, batch_json
from coderai.gateway.batches.runner import BatchRunner
from coderai.gateway.batches.validation import ENDPOINTS
from coderai.gateway.errors import ApiError
from coderai.gateway.http import json_response, query_int, read_json
from coderai.gateway.openai.files import Records, mine, page
from coderai.gateway.state import InferenceController
from coderai.runtime.kv import read_all

MAX_ERRORS = 1000  # validation errors a failed batch lists


class BatchRequest(msgspec.Struct, kw_only=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def _check(req: BatchRequest) -> None:
    if req.endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}.", param="endpoint", code="invalid_value")
    if req.completion_window not in WINDOWS:
        raise ApiError(400, "completion_window must be 24h.", param="completion_window", code="invalid_value")
    meta = req.metadata or {}
    if len(meta) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
        raise ApiError(
            400,
            "metadata holds at most 16 pairs, keys up to 64 and values up to 512 characters.",
            param="metadata",
            code="invalid_value",
        )


class BatchesController(InferenceController):
    path = "/v1/batches"
    records: Records
    batches: BatchRunner

    @post("/", status_code=200)
    async def create(self, request: Request) -> Response:
        """Check the file line by line (a bad line fails the batch, naming the line) and start it."""
        who = self.caller(request)
        req = await read_json(request, BatchRequest)
        _check(req)
        await self.gw.accounts.admit(who, None)  # rates and a spent budget; each line is admitted as it runs
        most = self.gw.settings.batches_per_key
        if most:
            running = sum(
                1
                for r in (await read_all(await self.batches.kv(), BatchRecord)).values()
                if r.key_name == who.key_name and r.status in RUNNING
            )
            if running >= most:
                raise ApiError(
                    429,
                    f"This key runs {running} batches already, its most; wait for one to end or cancel one.",
                    type="rate_limit_error",
                    code="batch_quota_exceeded",
                    headers={"Retry-After": str(self.gw.settings.retry_after_s)},
                )
        file = await self.records.own_file(who, req.input_file_id, "input_file_id")
        if file.purpose != "batch":
            raise ApiError(
                400,
                f"The file {file.id} has purpose '{file.purpose}'; a batch reads a file uploaded with purpose 'batch'.",
                param="input_file_id",
                code="invalid_value",
            )
        data = (await (await self.records.files()).get(file.id)).data or b""
        lines, errors = await self.batches.parse(data, req.endpoint)
        now = int(time.time())
        models = {ln.job.model for ln in lines}
        rec = BatchRecord(
            id="batch_" + secrets.token_hex(16),
            key_name=who.key_name,
            endpoint=req.endpoint,
            input_file_id=file.id,
            completion_window=req.completion_window,
            created_at=now,
            expires_at=now + WINDOWS[req.completion_window],
            updated_at=time.time(),
            metadata=req.metadata,
            model=models.pop() if len(models) == 1 else None,
            out_id="file-" + secrets.token_hex(12),
            err_id="file-" + secrets.token_hex(12),
            **(
                {"status": "failed", "failed_at": now, "errors": errors[:MAX_ERRORS]}
                if errors
                else {"status": "in_progress", "in_progress_at": now, "total": len(lines)}
            ),
        )
        rec = await self.batches.start(rec, lines, who)
        return json_response(batch_json(rec))

    @get("/")
    async def list_batches(self, request: Request) -> Response:
        """This key's batches, newest first, paged by `after`/`limit`."""
        who = self.caller(request)
        limit = query_int(request, "limit", 20, 1, 100)
        recs = [r for r in (await read_all(await self.batches.kv(), BatchRecord)).values() if mine(who, r.key_name)]
        recs.sort(key=lambda r: (r.created_at, r.id), reverse=True)
        data, more = page(recs, request.query_params.get("after"), limit)
        ends = {"first_id": data[0].id, "last_id": data[-1].id} if data else {}  # none on an empty page
        return json_response({"object": "list", "data": [batch_json(r) for r in data], "has_more": more, **ends})

    @get("/{batch_id:str}")
    async def retrieve(self, request: Request, batch_id: FromPath[str]) -> Response:
        return json_response(batch_json(await self._own(self.caller(request), batch_id)))

    @post("/{batch_id:str}/cancel", status_code=200)
    async def cancel(self, request: Request, batch_id: FromPath[str]) -> Response:
        """Lines not started are not run; answered ones still land in the output file."""
        rec = await self._own(self.caller(request), batch_id)
        if rec.status in ("completed", "failed", "expired"):
            raise ApiError(
                409, f"Cannot cancel a batch with status '{rec.status}'.", param="batch_id", code="invalid_state"
            )
        return json_response(batch_json(await self.batches.cancel(rec)))

    async def _own(self, who: Caller, batch_id: str) -> BatchRecord:
        missing = ApiError(404, f"No batch '{batch_id}'.", param="batch_id", code="not_found")
        if not batch_id.startswith("batch_") or not batch_id[6:].isalnum():
            raise missing
        try:
            entry = await (await self.batches.kv()).get(batch_id)
        except KeyNotFoundError:
            raise missing from None
        if entry is None or not entry.value:
            raise missing
        rec = msgspec.json.decode(entry.value, type=BatchRecord)
        if not mine(who, rec.key_name):
            raise missing
        return rec
