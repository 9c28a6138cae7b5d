"""A finished batch's output and error files, in OpenAI's format and in input order, kept as `/v1/files` files
(purpose `batch_output`, owned by the batch's key) under the ids drawn when the batch was made: a finalizing that
is done again (its gateway stopped half way) writes the same two files again, never a second copy. The lines go
from the bucket to the store through temporary files (`Spool`): a batch's answers are never all in memory."""

from __future__ import annotations

import asyncio
import io
import os
import tempfile
import time
from typing import TYPE_CHECKING, Any

import msgspec

from coderai.contracts import encode
from coderai.contracts.training import FileRecord
from coderai.gateway.batches.records import BatchRecord, LineResult

if TYPE_CHECKING:
    from coderai.gateway.openai.files import Records


def line_json(res: LineResult) -> dict[str, Any]:
    """One line of the output (a 2xx answer) or error file (an error answer, or none: `error` says why)."""
    response = None
    if res.status_code is not None:
        response = {"status_code": res.status_code, "request_id": res.request_id, "body": res.body}
    error = {"code": res.error_code, "message": res.error_message} if res.error_code else None
    return {"id": res.id, "custom_id": res.custom_id, "response": response, "error": error}


class Spool:
    """A finished batch's lines on their way to its two files, never all in memory: each line is rendered and
    written to a private temporary file as it is read (`add`), then copied out in input order into one temporary
    file per kind (`file`), which the object store reads in chunks."""

    def __init__(self) -> None:
        self.fh = tempfile.TemporaryFile()  # 0600, and unlinked at once: nothing another user can open
        self.at: dict[int, tuple[int, int, bool]] = {}  # line index -> (offset, length, ok)

    def add(self, res: LineResult) -> None:
        if res.index in self.at:
            return
        data = msgspec.json.encode(line_json(res)) + b"\n"
        self.fh.seek(0, os.SEEK_END)
        self.at[res.index] = (self.fh.tell(), len(data), res.ok)
        self.fh.write(data)

    def file(self, ok: bool) -> tuple[io.BufferedRandom, int] | None:
        """The lines of one kind (answered, or not), in input order, in a temporary file read from its start,
        and its size; None when there are none. Blocking: run it in a thread."""
        out = tempfile.TemporaryFile()
        for i in sorted(self.at):
            offset, length, good = self.at[i]
            if good == ok:
                self.fh.seek(offset)
                out.write(self.fh.read(length))
        size = out.tell()
        if not size:
            out.close()
            return None
        out.seek(0)
        return out, size

    @property
    def completed(self) -> int:
        return sum(1 for _, _, ok in self.at.values() if ok)

    def close(self) -> None:
        self.fh.close()


async def write(records: Records, rec: BatchRecord, spool: Spool) -> tuple[str | None, str | None]:
    """Keep both files (an empty one is not kept: its id stays None); their ids."""
    ids = []
    for file_id, ok, what in ((rec.out_id, True, "output"), (rec.err_id, False, "error")):
        got = await asyncio.to_thread(spool.file, ok)
        if got is None:
            ids.append(None)
            continue
        fh, size = got
        with fh:
            meta = FileRecord(
                id=file_id,
                bytes=size,
                created_at=int(time.time()),
                filename=f"{rec.id}_{what}.jsonl",
                purpose="batch_output",
                owner=rec.key_name,
            )
            await (await records.files()).put(file_id, fh)
        await (await records.kv()).put(file_id, encode(meta))
        ids.append(file_id)
    return ids[0], ids[1]
