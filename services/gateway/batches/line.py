"""One batch line run as a request of its key's: a `Call` sent as one part on the `WORK` queue (`queue.py`),
retried while the cluster answers 503 or the key's rate is full, and its outcome as the `LineResult` kept for the
output or error file (`runner.py` runs the lines in order and stores each)."""

from __future__ import annotations

import asyncio
import logging
import secrets
from functools import partial

import msgspec

from coderai.contracts import encode
from coderai.gateway.auth import Caller
from coderai.gateway.batches import queue, validation
from coderai.gateway.batches.records import LineResult
from coderai.gateway.errors import ApiError
from coderai.gateway.http import new_request_id
from coderai.gateway.pipeline import Call
from coderai.gateway.state import Gateway

log = logging.getLogger("coderai.gateway")

ATTEMPTS = 3  # a line refused as unavailable (503: no engine, a lost bus) is tried this many times


async def answer(gw: Gateway, line: validation.Line, who: Caller, lane: queue.Lane) -> LineResult:
    """The line run as a request of `who`'s: its answer, or the error a request would have got."""
    line_id = "batch_req_" + secrets.token_hex(16)
    attempt = 0
    while True:
        rid = new_request_id()
        call = Call(gw, who, line.op, msgspec.structs.replace(line.job, request_id=rid), client_id=line.custom_id)
        try:
            final = await call.queued(partial(queue.send, gw, lane, line.op))
            body = line.render(final, rid, call.created)
        except ApiError as err:
            attempt += err.status == 503
            if err.code == "rate_limit_exceeded" or (err.status == 503 and attempt < ATTEMPTS):
                await asyncio.sleep(float(err.headers.get("Retry-After", 1)))  # the key's rate, or a blink
                continue
            return LineResult(
                index=line.index,
                custom_id=line.custom_id,
                id=line_id,
                request_id=rid,
                status_code=err.status,
                body=msgspec.Raw(err.encode()),
            )
        except Exception as exc:  # one line's bug fails that line, not the batch
            log.exception("batch line %s failed", line.custom_id)
            err = ApiError(500, f"Internal error: {type(exc).__name__}", type="server_error", code="internal")
            return LineResult(
                index=line.index,
                custom_id=line.custom_id,
                id=line_id,
                request_id=rid,
                status_code=500,
                body=msgspec.Raw(err.encode()),
            )
        return LineResult(
            index=line.index,
            custom_id=line.custom_id,
            id=line_id,
            request_id=rid,
            status_code=200,
            body=msgspec.Raw(encode(body)),
            prompt_tokens=final.usage.prompt_tokens,
            completion_tokens=final.usage.completion_tokens,
        )


def within(res: LineResult, limit: int) -> LineResult:
    """`res`, or a 500 `response_too_large` in its place when it is over the `limit` bytes one kept line (a KV
    value: one bus message) holds."""
    if len(msgspec.json.encode(res)) <= limit:
        return res
    err = ApiError(
        500,
        f"The answer is over the {limit} bytes one kept line holds; send fewer inputs per line.",
        type="server_error",
        code="response_too_large",
    )
    return msgspec.structs.replace(res, status_code=500, body=msgspec.Raw(err.encode()))


def expired(ln: validation.Line) -> LineResult:
    """A line the completion window passed before it was answered, as the error file has it."""
    return LineResult(
        index=ln.index,
        custom_id=ln.custom_id,
        id="batch_req_" + secrets.token_hex(16),
        error_code="batch_expired",
        error_message="This request could not be executed before the completion window expired.",
    )
