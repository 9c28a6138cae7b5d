"""A finished batch's output and error files, in OpenAI's format and in input order, kept as `/v1/files` files
(purpose `batch_output`, owned by the batch's key) under the ids drawn when the batch was made: a finalizing that
is done again (its gateway stopped half way) writes the same two files again, never a second copy."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from coderai.contracts import encode
from coderai.contracts.training import FileRecord
from coderai.gateway.batches.records import BatchRecord, LineResult


def line_json(res: LineResult) -> dict[str, Any]:
    """One line of the output (a 2xx answer) or error file (an error answer, or none: `error` says why)."""
    response = None
    if res.status_code is not None:
        response = {"status_code": res.status_code, "request_id": res.request_id, "body": res.body}
    error = {"code": res.error_code, "message": res.error_message} if res.error_code else None
    return {"id": res.id, "custom_id": res.custom_id, "response": response, "error": error}


def render(results: dict[int, LineResult]) -> tuple[bytes, bytes]:
    """The output file's bytes and the error file's, each line in input order."""
    ok, failed = [], []
    for i in sorted(results):
        res = results[i]
        (ok if res.ok else failed).append(msgspec.json.encode(line_json(res)) + b"\n")
    return b"".join(ok), b"".join(failed)


async def write(records: Any, rec: BatchRecord, results: dict[int, LineResult]) -> tuple[str | None, str | None]:
    """Keep both files (an empty one is not kept: its id stays None); their ids."""
    out, err = render(results)
    ids = []
    for file_id, data, what in ((rec.out_id, out, "output"), (rec.err_id, err, "error")):
        if not data:
            ids.append(None)
            continue
        meta = FileRecord(id=file_id, bytes=len(data), created_at=int(time.time()),
                          filename=f"{rec.id}_{what}.jsonl", purpose="batch_output", owner=rec.key_name)
        await (await records.files()).put(file_id, data)
        await (await records.kv()).put(file_id, encode(meta))
        ids.append(file_id)
    return ids[0], ids[1]
