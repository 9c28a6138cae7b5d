"""The pipeline's last stage, exactly once on every path: the usage billed (as far as this request could have
used it), the key's reservation released and its charges made, one `request.completed` published. A client that
leaves stops the engine and is still accounted; an error is accounted and mapped to the client's `ApiError`.

`Call.finish`, `Call.finish_detached`, `Call.abandon` and `Call.fail` run these.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from nats.errors import Error as NatsError

from coderai.contracts import BusError, Final, RequestCompleted, Usage
from coderai.gateway.pricing import checked_usage, price, usage_ceiling
from coderai.gateway.errors import ApiError, from_bus
from coderai.media_work import Work

if TYPE_CHECKING:
    from coderai.gateway.pipeline import Call

log = logging.getLogger("coderai.gateway")

_NO_USAGE = Usage()


async def finish(call: Call, final: Final | None = None, usage: Usage | None = None) -> None:
    """Account once: the usage (of `final`), the key's charges, `request.completed`."""
    if call._finished:
        return
    call._finished = True
    if call._refresher is not None:
        call._refresher.cancel()
    if call.stream is not None:
        call.stream.close()
    if final is not None:
        call.usage = final.usage
    if usage is not None:
        call.usage = usage
    if call.admitted and call.usage != _NO_USAGE:
        call.usage = _checked(call, call.usage)
    done = RequestCompleted(
        request_id=call.job.request_id,
        ts=time.time(),
        key_name=call.who.key_name,
        model=call.job.model,
        op=call.op,
        status=call.status,
        http_status=call.http_status,
        engine_id=call.engine_id,
        node_id=call.node_id,
        duration_s=time.monotonic() - call.started,
        ttft_s=call.ttft_s,
        prompt_tokens=call.usage.prompt_tokens,
        completion_tokens=call.usage.completion_tokens,
        stream=call.streamed,
        route_reason=call.route_reason,
        cost_usd=price(call.cfg, call.usage, _billed_work(call)),
        parts=call.parts,
        client_request_id=call.client_id,
    )
    await call.gw.accounts.finish(call.who, call.admission, done, call.trace)


def _billed_work(call: Call) -> Work | None:
    """The image or video work to bill: all of it once an engine gave an answer, or took the job and was then
    left by its client (the GPU was given to it either way); none for a job refused or failed."""
    if call.admitted and (call.status == "ok" or (call.status == "cancelled" and call.engine_id)):
        return call.work
    return None


def _checked(call: Call, usage: Usage) -> Usage:
    """The usage an engine reported, as far as this request could have used it: what a node says it used is
    billed only within what the gateway saw (never negative, never past max_tokens or the context), and
    anything beyond is logged as the node's fault."""

    def size() -> int:
        return len(call.encoded) if call.encoded is not None else len(call.spec.subject.encode(call.job))

    prompt_most, completion_most = usage_ceiling(call.cfg, call.job, call.spec.llm, size, usage.prompt_tokens)
    checked, why = checked_usage(usage, prompt_most, completion_most)
    if why:
        log.warning(
            "node fault: engine %s of node %s reported impossible usage (%s); billed %d + %d tokens",
            call.engine_id or "?",
            call.node_id or "?",
            why,
            checked.prompt_tokens,
            checked.completion_tokens,
            extra={"request_id": call.job.request_id},
        )
    return checked


def finish_detached(call: Call, final: Final | None = None) -> None:
    """`finish`, as a task of its own (from a stream whose task may be being cancelled)."""
    call.gw.relay.spawn(call.finish(final))


def abandon(call: Call) -> None:
    """The client went away: stop the engine, and still account (detached from the cancelled task). Logged
    once, at INFO: a client leaving is no fault of the gateway's (no traceback, no warning)."""
    if not call._finished and call.status != "cancelled":
        log.info(
            "client disconnected",
            extra={
                "request_id": call.job.request_id,
                "fields": {
                    "op": call.op,
                    "model": call.job.model,
                    "stream": call.streamed,
                    "first_frame": call.ttft_s is not None,
                    "waited_ms": round((time.monotonic() - call.started) * 1000, 1),
                },
            },
        )
    call.status, call.http_status = "cancelled", 499
    if call.stream is not None:
        call.gw.relay.spawn(call.stream.cancel())
    call.finish_detached()


async def fail(call: Call, exc: BaseException) -> BaseException:
    """Account for a call that ends in `exc`; what to raise in its place (the client's ApiError)."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        call.abandon()
        return exc
    if isinstance(exc, BusError):
        err = from_bus(exc, call.gw.settings.retry_after_s)
    elif isinstance(exc, NatsError):  # a publish not acked (NATS restarting, JetStream out of disk)
        log.warning("request %s: the message bus did not take it: %s", call.job.request_id, exc)
        err = ApiError(
            503,
            "The cluster could not take the request just now; try again shortly.",
            type="service_unavailable",
            code="bus_unavailable",
            headers={"Retry-After": str(call.gw.settings.retry_after_s)},
        )
    else:
        err = exc
    if isinstance(err, ApiError):
        call.status, call.http_status = err.code or "error", err.status
    else:
        call.status, call.http_status = "error", 500
    await call.finish()
    return err
