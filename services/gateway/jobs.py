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

from coderai.contracts import BusError, Chunk, ErrorReply, Final, ModelConfig
from coderai.contracts.topology import HDR_KEY_NAME, HDR_REQUEST_ID
from coderai.gateway.auth import Caller
from coderai.gateway.errors import ApiError, from_bus
from coderai.gateway.relay import Hints, Outcome, next_frame
from coderai.runtime.bus import FrameStream

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


async def start(gw: Any, who: Caller, op: str, job: Any) -> tuple[Call, Chunk | Final]:
    """Admit and route the job, and wait for its first frame (failing over to another engine before it)."""
    cfg = model_for(gw, job.model, op)
    estimate = await gw.admit(who, cfg, job)
    outcome = Outcome(request_id=job.request_id, key_name=who.key_name, model=job.model, op=op, stream=job.stream)
    outcome.start_span(SPAN_NAMES[op])
    call = Call(gw, who, cfg, op, outcome, estimate)
    headers = {HDR_REQUEST_ID: job.request_id, HDR_KEY_NAME: who.key_name}
    try:
        job = await gw.blobs.pack(job)
        call.stream, first = await gw.relay.first_frame(op, job, Hints(), outcome, headers)
    except BusError as exc:
        err = from_bus(exc, gw.settings.retry_after_s)
        call.fail(err.code or "error", err.status)
        await call.finish()
        raise err from None
    except ApiError as err:
        call.fail(err.code or "error", err.status)
        await call.finish()
        raise
    outcome.ttft_s = time.monotonic() - outcome.started
    return call, first


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


async def run(gw: Any, who: Caller, op: str, job: Any, on_chunk: OnChunk | None = None) -> tuple[Call, Final]:
    """The whole job: its final frame with the output's blobs inline. Chunks go to `on_chunk`."""
    call, first = await start(gw, who, op, job)
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
    except asyncio.CancelledError:
        call.abandon()
        raise
    except BusError as exc:
        err = from_bus(exc, gw.settings.retry_after_s)
        call.fail(err.code or "error", err.status)
        await call.finish()
        raise err from None
    except BaseException:
        call.fail("error", 500)
        await call.finish()
        raise
    raise AssertionError("unreachable: frames() ends with a Final")


def response_headers(call: Call) -> dict[str, str]:
    return {HDR_REQUEST_ID: call.outcome.request_id, "Coderai-Engine": call.outcome.engine_id,
            "Coderai-Route": call.outcome.route_reason}
