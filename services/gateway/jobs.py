"""One media job through the bus: admit, route, send, gather frames until the result; account for it once.

The LLM path (app.py `_serve`) relays tokens as they come; media answers are whole results (or, for speech,
a byte stream), so they share this smaller path. Blobs go out packed (big ones in the object store) and the
result's blobs come back inline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from coderai.contracts import BusError, Chunk, ErrorReply, Final, ModelConfig, RouteDecision
from coderai.contracts.topology import HDR_KEY_NAME, HDR_REQUEST_ID
from coderai.gateway import fanout_plans
from coderai.gateway.auth import Caller
from coderai.gateway.errors import ApiError, from_bus
from coderai.gateway.relay import Hints, Outcome, next_frame
from coderai.gateway.scatter import scatter
from coderai.runtime.bus import FrameStream

FANOUT_OPS = frozenset({"embed", "rerank", "image", "speech", "transcribe", "ocr"})  # never chat: tokens stream

SPAN_NAMES = {
    "embed": "POST /v1/embeddings", "rerank": "POST /v1/rerank", "image": "POST /v1/images",
    "speech": "POST /v1/audio/speech", "transcribe": "POST /v1/audio/transcriptions",
    "diarize": "POST /v1/audio/diarization", "ocr": "POST /v1/ocr", "video": "POST /v1/videos",
}

OnChunk = Callable[[Chunk], Awaitable[None]]


@dataclass
class Call:
    """A job under way: where it went, what it has cost so far, and how to finish its accounting."""

    gw: Any
    who: Caller
    cfg: ModelConfig
    op: str
    outcome: Outcome
    estimate: float
    stream: FrameStream | None = None
    finished: bool = False

    def fail(self, status: str, http_status: int) -> None:
        self.outcome.status, self.outcome.http_status = status, http_status

    async def finish(self, final: Final | None = None) -> None:
        """Account once: tokens from the final frame, `request.completed`, key charges."""
        if self.finished:
            return
        self.finished = True
        if self.stream is not None:
            self.stream.close()
        if final is not None:
            self.outcome.prompt_tokens = final.usage.prompt_tokens
            self.outcome.completion_tokens = final.usage.completion_tokens
        await self.gw.finish(self.outcome, self.who, self.cfg, self.estimate)

    def abandon(self) -> None:
        """The client went away: stop the engine, and still account (detached from the cancelled task)."""
        self.fail("cancelled", 499)
        if self.stream is not None:
            self.gw.relay.spawn(self.stream.cancel())
        self.gw.relay.spawn(self.finish())


def model_for(gw: Any, name: str, op: str) -> ModelConfig:
    cfg = gw.model(name)
    if op not in cfg.serves():
        raise ApiError(400, f"The model '{name}' does not serve {op}; it serves {', '.join(cfg.serves())}.",
                       param="model", code="unsupported_operation")
    return cfg


async def admit(gw: Any, who: Caller, op: str, job: Any) -> Call:
    """Check the model and the key's limits; the call whose accounting `finish` closes."""
    cfg = model_for(gw, job.model, op)
    estimate = await gw.admit(who, cfg, job)
    outcome = Outcome(request_id=job.request_id, key_name=who.key_name, model=job.model, op=op, stream=job.stream)
    outcome.start_span(SPAN_NAMES[op])
    return Call(gw, who, cfg, op, outcome, estimate)


def _headers(call: Call) -> dict[str, str]:
    return {HDR_REQUEST_ID: call.outcome.request_id, HDR_KEY_NAME: call.who.key_name}


async def start(call: Call, job: Any, decision: RouteDecision | None = None) -> Chunk | Final:
    """Route the admitted job and wait for its first frame (failing over to another engine before it);
    `decision`: a route already asked for, reused for the first try."""
    gw, op = call.gw, call.op
    try:
        job = await gw.blobs.pack(job)
        call.stream, first = await gw.relay.first_frame(op, job, Hints(), call.outcome, _headers(call), decision)
    except BaseException as exc:
        await _failed(call, exc)
        raise _api(gw, exc) from None
    call.outcome.ttft_s = time.monotonic() - call.outcome.started
    return first


def _api(gw: Any, exc: BaseException) -> BaseException:
    return from_bus(exc, gw.settings.retry_after_s) if isinstance(exc, BusError) else exc


async def _failed(call: Call, exc: BaseException) -> None:
    """Account for a call that ends in `exc` (detached when the client went away)."""
    if isinstance(exc, asyncio.CancelledError):
        call.abandon()
        return
    err = _api(call.gw, exc)
    if isinstance(err, ApiError):
        call.fail(err.code or "error", err.status)
    else:
        call.fail("error", 500)
    await call.finish()


async def frames(call: Call, first: Chunk | Final) -> AsyncIterator[Chunk | Final]:
    """The job's chunks and then its final frame; an engine error is raised as an ApiError."""
    frame: Any = first
    while True:
        if isinstance(frame, ErrorReply):
            raise BusError.from_reply(frame)
        yield frame
        if isinstance(frame, Final):
            return
        frame = await next_frame(call.stream)  # type: ignore[arg-type]


async def fan_out(call: Call, op: str, job: Any) -> tuple[Final | None, RouteDecision | None]:
    """Split the job over the workers holding its model when its `distribute` settings allow and two or more
    hold it: the merged `Final`. Otherwise (None, the route decision to reuse for the single engine)."""
    gw, d = call.gw, call.cfg.distribute
    if op not in FANOUT_OPS or not d.enabled or job.stream:
        return None, None
    try:
        decision = await gw.relay.route(job, op, Hints(), [], _headers(call))
        settings = fanout_plans.Distribute(enabled=d.enabled, max_parts=d.max_parts, min_items=d.min_items)
        plan = None
        if decision.holders >= 2:  # transcription and OCR plans decode the upload: off the event loop
            plan = await asyncio.to_thread(fanout_plans.plan, op, job, decision.holders, settings)
        if plan is None:
            return None, decision
        call.outcome.route_reason, call.outcome.parts = "fanout", len(plan.jobs)
        final = await scatter(gw, op, job, plan, _headers(call))
    except BaseException as exc:
        await _failed(call, exc)
        raise _api(gw, exc) from None
    call.outcome.engine_id = final.engine_id
    call.outcome.ttft_s = time.monotonic() - call.outcome.started
    await call.finish(final)
    return final, None


async def run(gw: Any, who: Caller, op: str, job: Any, on_chunk: OnChunk | None = None) -> tuple[Call, Final]:
    """The whole job: its final frame with the output's blobs inline. Chunks go to `on_chunk`. A job the model's
    `distribute` settings allow to split, with two or more engines holding the model, fans out over them."""
    call = await admit(gw, who, op, job)
    final, decision = await fan_out(call, op, job)
    if final is not None:
        return call, final
    first = await start(call, job, decision)
    try:
        async for frame in frames(call, first):
            if isinstance(frame, Final):
                output = await gw.blobs.unpack(frame.output) if frame.output is not None else None
                final = Final(seq=frame.seq, engine_id=frame.engine_id, output=output, usage=frame.usage,
                              ttft_s=frame.ttft_s)
                await call.finish(final)
                return call, final
            if on_chunk is not None:
                await on_chunk(frame)
    except BaseException as exc:
        await _failed(call, exc)
        raise _api(gw, exc) from None
    raise AssertionError("unreachable: frames() ends with a Final")


def response_headers(call: Call) -> dict[str, str]:
    return {HDR_REQUEST_ID: call.outcome.request_id, "Coderai-Engine": call.outcome.engine_id,
            "Coderai-Route": call.outcome.route_reason}
