"""One request pipeline for every endpoint: admit -> fan-out | pick + first frame (failing over before it) ->
frames -> account exactly once (or a batch line's one part on the `WORK` queue: `Call.queued`).

A controller builds the op's job and a `Call`, then hands it to the adapter for its answer's shape: `answer` for a
whole answer (a JSON body), `relay_stream` for frames relayed as they come (SSE tokens, audio bytes). Whatever
happens (an error before or after the first frame, the client leaving, streamed or not), the engine job is
cancelled when nobody waits for it, the key's budget reservation is released and one `request.completed` is
published. Only the pipeline calls the relay's `first_frame` and `spawn` and the accounts' `finish`.

This module is the call and its stages in order; each stage is a module of its own: `pipeline_admit` (the key's
limits, the job shaped to the model, the budget), `pipeline_route` (fan-out or one engine, failing over before
the first frame), `pipeline_account` (the end, exactly once) and `pipeline_answer` (the adapters).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from coderai.contracts import ChatJob, Chunk, Final, ModelConfig, RequestId, RouteRequest, Usage
from coderai.contracts.jobs import EngineOp
from coderai.contracts.ops import OPS
from coderai.contracts.topology import HDR_KEEP_ALIVE, HDR_KEY_NAME, HDR_REQUEST_ID
from coderai.gateway import pipeline_account, pipeline_admit, pipeline_route, seal
from coderai.gateway.accounting import NO_TRACE, Admission, Trace
from coderai.gateway.auth import Caller
from coderai.gateway.http import ENGINE_HEADER, ROUTE_HEADER, client_request_id_var, new_request_id
from coderai.gateway.pipeline_admit import HEADROOM, output_limited
from coderai.gateway.pipeline_answer import answer, open_stream, relay_stream
from coderai.gateway.state import Gateway
from coderai.media_work import Work
from coderai.runtime import tracing
from coderai.runtime.bus import FrameStream

__all__ = ["HEADROOM", "Call", "answer", "open_stream", "output_limited", "relay_stream", "touch"]

NOT_ADMITTED = Admission(None)


class Call:
    """One request, from admission to its one `request.completed`: where it went and what it used."""

    __slots__ = (
        "gw",
        "who",
        "op",
        "job",
        "route",
        "spec",
        "started",
        "created",
        "streamed",
        "trace",
        "admission",
        "stream",
        "engine_id",
        "node_id",
        "route_reason",
        "parts",
        "ttft_s",
        "usage",
        "status",
        "http_status",
        "encoded",
        "_refresher",
        "admitted",
        "_finished",
        "keep_alive_s",
        "on_loading",
        "client_id",
        "work",
    )

    def __init__(
        self,
        gw: Gateway,
        who: Caller,
        op: EngineOp,
        job: Any,
        route: RouteRequest | None = None,
        keep_alive_s: float | None = None,
        client_id: str | None = None,
    ) -> None:
        """`route`: what the router is asked (the model and op, and a chat's affinity hints and pin);
        `keep_alive_s`: how long the model should then stay loaded idle (Ollama's keep_alive), None: its own;
        `client_id`: the client's own id for it, kept with its usage (None: the HTTP request's
        X-Client-Request-Id)."""
        self.gw, self.who, self.job = gw, who, job
        self.op: EngineOp = op
        self.client_id = client_request_id_var.get() if client_id is None else client_id
        self.keep_alive_s = keep_alive_s
        self.on_loading: Callable[[], None] | None = None  # called if the model must first be loaded on demand
        self.route = route or RouteRequest(request_id=job.request_id, model=job.model, op=op)
        self.spec = OPS[op]
        self.started = time.monotonic()
        self.created = int(time.time())
        self.streamed = bool(getattr(job, "stream", False))
        self.trace = Trace() if tracing.enabled() else NO_TRACE
        self.admission = NOT_ADMITTED
        self.stream: FrameStream | None = None
        self.engine_id = self.node_id = self.route_reason = ""
        self.parts = 0
        self.ttft_s: float | None = None
        self.usage = Usage()
        self.work: Work | None = None  # an image or video job's pixels x steps, billed once an engine took it
        self.status, self.http_status = "ok", 200
        self.encoded: bytes | None = None  # the job as sent, once measured
        self._refresher: asyncio.Task | None = None
        self.admitted = False
        self._finished = False

    @property
    def cfg(self) -> ModelConfig:
        assert self.admission.cfg is not None, "the call is not admitted yet"
        return self.admission.cfg

    @property
    def request_id(self) -> str:
        return self.job.request_id

    def bus_headers(self) -> dict[str, str]:
        headers = {HDR_REQUEST_ID: self.job.request_id, HDR_KEY_NAME: self.who.key_name}
        if self.keep_alive_s is not None:
            headers[HDR_KEEP_ALIVE] = repr(self.keep_alive_s)
        return headers

    def response_headers(self) -> dict[str, str]:
        engine = self.engine_id
        if engine and "admin" not in self.who.scopes:  # a node's id (often its host name) is the operator's to see
            engine = ",".join(seal.sealer().handle(e) for e in engine.split(","))
        return {HDR_REQUEST_ID: self.job.request_id, ENGINE_HEADER: engine, ROUTE_HEADER: self.route_reason}

    # --- the stages, in order --------------------------------------------------------------------------

    async def admit(self) -> ModelConfig:
        """The model (serving this op), a body the bus can carry, then the key's limits (`pipeline_admit`)."""
        return await pipeline_admit.admit(self)

    async def open(self, *, stream: bool = False) -> Chunk | Final:
        """The first frame: the merged answer of a fan-out, or one engine's first frame (`pipeline_route`).
        `stream`: send the job streamed when it goes to one engine (speech: bytes as they come)."""
        return await pipeline_route.open_first(self, stream)

    async def queued(self, send: Callable[[Any, dict[str, str]], Awaitable[Final]]) -> Final:
        """The whole answer when the job runs as one part on the `WORK` queue instead of through `open` (a batch
        line); `send(job, headers)` publishes it and waits for its `Final` (`pipeline_route`)."""
        return await pipeline_route.queued(self, send)

    async def next(self) -> Chunk | Final:
        """The frame after the first ones; an engine's error is raised as a BusError."""
        return await pipeline_route.next_after(self)

    # --- the end, exactly once ---------------------------------------------------------------------------

    async def unpacked(self, final: Final) -> Final:
        """`final` with the blobs its output names read back (a media op's bytes travel as blobs)."""
        if final.output is None:
            return final
        return msgspec.structs.replace(final, output=await self.gw.blobs.unpack(final.output))

    async def finish(self, final: Final | None = None, usage: Usage | None = None) -> None:
        """Account once: the usage (of `final`), the key's charges, `request.completed` (`pipeline_account`)."""
        await pipeline_account.finish(self, final, usage)

    def finish_detached(self, final: Final | None = None) -> None:
        """`finish`, as a task of its own (from a stream whose task may be being cancelled)."""
        pipeline_account.finish_detached(self, final)

    def abandon(self) -> None:
        """The client went away: stop the engine, and still account (detached from the cancelled task)."""
        pipeline_account.abandon(self)

    async def fail(self, exc: BaseException) -> BaseException:
        """Account for a call that ends in `exc`; what to raise in its place (the client's ApiError)."""
        return await pipeline_account.fail(self, exc)


async def touch(gw: Gateway, who: Caller, model: str, keep_alive_s: float | None, request: Any) -> Call:
    """Load `model` without generating: an empty chat job any of its engines answers at once (loading it on demand
    first), with the keep-alive asked (0: let it go once idle; a tenant's is bounded in `pipeline_admit`). The call,
    for its response headers and the keep-alive it was given."""
    job = ChatJob(request_id=RequestId(new_request_id()), model=model, messages=[])
    call = Call(gw, who, "chat", job, keep_alive_s=keep_alive_s)
    await answer(call, request)
    return call
