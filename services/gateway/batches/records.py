"""A batch's record and its lines' results, and how a batch outlives the gateway that accepted it.

The record (`coderai_batches`, key = the batch id) carries the state the API shows and which gateway runs it
(`runner`). Each answered line's result is a key of its own in `coderai_batch_lines` (`<batch id>.<index>`),
created once: a second write of a line (a duplicate answer, a runner that was taken for dead) is refused by the
bucket, so no line is counted or written out twice, and a runner that resumes a batch re-runs only the lines with
no result. The runner touches the record every few seconds; a running record nobody wrote for the takeover
threshold is claimed by one gateway replica with a revision-checked write (`coderai.gateway.takeover`, as video
jobs are).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import msgspec
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from coderai.contracts.base import Message
from coderai.gateway.takeover import Tenure
from coderai.runtime.kv import replay

Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"]
RUNNING = ("validating", "in_progress", "finalizing", "cancelling")
WINDOWS = {"24h": 24 * 3600}  # OpenAI's only completion window
MAX_TAKEOVERS = 5


class LineError(Message, frozen=True, kw_only=True):
    """A problem with one line of the input file (OpenAI's `errors.data` item); `line` counts from 1."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchRecord(Message, frozen=True, kw_only=True):
    id: str
    key_name: str
    endpoint: str
    input_file_id: str
    completion_window: str = "24h"
    status: Status
    created_at: int
    expires_at: int
    updated_at: float
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: list[LineError] = []
    metadata: dict[str, str] | None = None
    model: str | None = None
    ending: str = ""  # while finalizing: the status it ends in (completed, cancelled, expired)
    output_file_id: str | None = None  # set once the file is written
    error_file_id: str | None = None
    out_id: str = ""  # the output and error files' ids, drawn at creation: a finalizing retried writes them again
    err_id: str = ""
    runner: str = ""
    takeovers: int = 0


class LineResult(Message, frozen=True, kw_only=True):
    """One line's outcome as it goes into the output file (`status_code` 200) or the error file (an error status
    with the error body, or no response at all: `error_code` and `error_message`, e.g. `batch_expired`)."""

    index: int
    custom_id: str
    id: str  # batch_req_...
    request_id: str = ""
    status_code: int | None = None
    body: msgspec.Raw = msgspec.Raw(b"null")  # the response body as sent (Raw | None does not decode)
    error_code: str | None = None
    error_message: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def line_key(batch_id: str, index: int) -> str:
    return f"{batch_id}.{index}"


def batch_json(rec: BatchRecord) -> dict[str, Any]:
    """The batch object, in OpenAI's shape; a field not set yet (a timestamp, a file, `errors`) is left out, as
    OpenAI's schema has no null for them (the SDK reads a missing one as None)."""
    errors = {"object": "list", "data": [msgspec.to_builtins(e) for e in rec.errors]} if rec.errors else None
    body = {
        "id": rec.id,
        "object": "batch",
        "endpoint": rec.endpoint,
        "errors": errors,
        "input_file_id": rec.input_file_id,
        "completion_window": rec.completion_window,
        "status": rec.status,
        "output_file_id": rec.output_file_id,
        "error_file_id": rec.error_file_id,
        "created_at": rec.created_at,
        "in_progress_at": rec.in_progress_at,
        "expires_at": rec.expires_at,
        "finalizing_at": rec.finalizing_at,
        "completed_at": rec.completed_at,
        "failed_at": rec.failed_at,
        "expired_at": rec.expired_at,
        "cancelling_at": rec.cancelling_at,
        "cancelled_at": rec.cancelled_at,
        "request_counts": {"total": rec.total, "completed": rec.completed, "failed": rec.failed},
        "metadata": rec.metadata,
        "model": rec.model,
        "usage": {
            "input_tokens": rec.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": rec.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": rec.prompt_tokens + rec.completion_tokens,
        },
    }
    return {k: v for k, v in body.items() if v is not None or k == "metadata"}


def due(rec: BatchRecord, quiet_s: float, after_s: float) -> bool:
    """A running batch nobody wrote for `after_s` (measured on the sweeping gateway's own clock): its gateway
    stopped."""
    return rec.status in RUNNING and quiet_s > after_s


def claim(rec: BatchRecord, runner: str, now: float, max_takeovers: int = MAX_TAKEOVERS) -> BatchRecord:
    """The record as the replica taking the batch over writes it; past the takeover bound it is failed instead."""
    if rec.takeovers >= max_takeovers:
        err = LineError(
            code="runner_lost",
            message=f"The gateway running this batch stopped {rec.takeovers + 1} times; it is not taken over again.",
        )
        return msgspec.structs.replace(
            rec, status="failed", failed_at=int(now), updated_at=now, runner=runner, errors=[*rec.errors, err]
        )
    return msgspec.structs.replace(rec, runner=runner, takeovers=rec.takeovers + 1, updated_at=now)


class BatchTenure(Tenure[BatchRecord]):
    """A batch runner's hold on its batch's record. A write that loses to a cancel (the only change another gateway
    makes to a running batch) keeps the cancel and goes on."""

    record = BatchRecord

    @property
    def cancelling(self) -> bool:
        return self.rec.status == "cancelling"

    def lost(self, current: BatchRecord, changes: dict[str, object]) -> dict[str, object]:
        if current.status == "cancelling" and changes.get("status") == "in_progress":
            return {k: v for k, v in changes.items() if k not in ("status", "in_progress_at")}
        return changes

    async def refresh(self) -> None:
        """Read the record again (a cancel may have come in through another gateway)."""
        async with self.lock:
            await self.reread({})


async def each_line(kv: KeyValue, batch_id: str, take: Callable[[LineResult], None]) -> None:
    """Every stored result of a batch's lines, handed to `take` one by one as one watch replays the batch's keys:
    never all of them in memory at once (a batch's answers can be far larger than a gateway's memory)."""
    watcher = await kv.watch(f"{batch_id}.*", ignore_deletes=True)
    try:  # to the replay's real end: nats-py's end marker can come first (a finished batch then read no answer)
        async for entry in replay(watcher):
            if entry.value:
                take(msgspec.json.decode(entry.value, type=LineResult))
    finally:
        await watcher.stop()


class Tally:
    """What a batch's answered lines add up to, without their bodies: which lines are done, and the counts."""

    def __init__(self) -> None:
        self.done: set[int] = set()
        self.completed = self.failed = self.prompt_tokens = self.completion_tokens = 0

    def add(self, res: LineResult) -> None:
        if res.index in self.done:
            return
        self.done.add(res.index)
        self.completed += res.ok
        self.failed += not res.ok
        self.prompt_tokens += res.prompt_tokens
        self.completion_tokens += res.completion_tokens

    def counts(self) -> dict[str, int]:
        return dict(
            completed=self.completed,
            failed=self.failed,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
        )


async def store_line(kv: KeyValue, batch_id: str, res: LineResult) -> bool:
    """Keep a line's result unless one is kept already; whether this one was."""
    try:
        await kv.create(line_key(batch_id, res.index), msgspec.json.encode(res))
    except KeyWrongLastSequenceError:
        return False
    return True
