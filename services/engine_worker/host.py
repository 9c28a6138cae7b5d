"""One loaded engine on the bus: its subscriptions, its job thread, its cancel flags and its counters."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import msgspec
from nats.aio.msg import Msg

from coderai.contracts import (
    GGUF_FAMILIES,
    BusError,
    CancelJob,
    Chunk,
    EngineStatus,
    ErrorReply,
    Final,
    ModelConfig,
    ModelFetch,
    Usage,
    model_key,
)
from coderai.contracts.ops import BATCH_OPS, ENGINE_OPS, FANOUT_OPS, LLM_OPS
from coderai.contracts.nodes import EngineState
from coderai.contracts.subjects import ENGINE_CANCEL, EVT_MODEL_FETCH
from coderai.contracts.topology import HDR_KEEP_ALIVE, HDR_REQUEST_ID
from coderai.engine_worker import handover, stage_host
from coderai.engine_worker.engines import Engine, EngineLoadError, engine_class, resolve
from coderai.engine_worker.engines.base import EngineLost, unhonoured
from coderai.engine_worker.engines.base import CancelFlag
from coderai.engine_worker.fetch import bus_request
from coderai.engine_worker.gate import PriorityGate
from coderai.engine_worker.weights import ensure_weights
from coderai.engine_worker.parts import PartPuller
from coderai import engine_params
from coderai.catalog import ModelStore
from coderai.runtime import tracing
from coderai.runtime.blobs import BlobMissing, BlobProxy
from coderai.runtime.bus import DONE, Bus, FrameWriter, pump
from coderai.runtime.logging import request_id_var
from coderai.sizing import estimate_bytes

log = logging.getLogger("coderai.engine_worker")
JobOutcome = Literal["ok", "failed", "retry"]  # how a job ended (a fan-out part's PartDone.status)
EARLY_CANCELS = 1024  # cancels kept for jobs not arrived yet
# a job is admitted while its expected wait for a slot is under this (a model's `queue_time_s` overrides it): a
# burst of an agent's subagents, or a UI's tasks beside a turn, queues; a queue that would take minutes says so
DEFAULT_QUEUE_TIME_S = 60.0


def engine_id_for(node_id: str, model: str) -> str:
    return f"{node_id}-{model_key(model)}"


def keep_alive_header(value: str, old: float | None) -> float | None:
    """A job's keep_alive header in seconds (< 0: forever); a malformed one (from a node's peer, never the gateway)
    leaves the old value."""
    try:
        seconds = float(value)
    except ValueError:
        return old
    return seconds if seconds == seconds else old  # NaN is no duration


class EngineHost:
    """Runs one engine: jobs go to a single thread in arrival order; frames go back on the bus."""

    def __init__(
        self,
        bus: Bus,
        node_id: str,
        config: ModelConfig,
        keepalive_s: float,
        models_dir: Path | None = None,
        weights: ModelStore | None = None,
        share_cache: bool = True,
    ) -> None:
        self.bus = bus
        self.share_cache = share_cache  # the worker's default for a model that does not say (WorkerSettings)
        self.models_dir = models_dir  # where files fetched from the head's store go; None: never fetch
        # where weights fetched by the model's `source` go (a pod's network volume): by default beside the others
        self.weights = weights or (ModelStore(models_dir.parent, root=models_dir) if models_dir is not None else None)
        self.node_id = node_id
        self.config = config
        self.engine_id = engine_id_for(node_id, config.name)
        self.keepalive_s = keepalive_s
        self.state: EngineState = "loading"
        self.error: str | None = None
        self.in_flight = 0
        self.served = 0
        self.service_s = 0.0  # how long a job held a slot, lately (a moving average): what a queue's wait is told by
        self.load_s = 0.0
        self.used_at = time.monotonic()  # when its last job ended (or it loaded): the scheduler's idle clock
        self.keep_alive_s: float | None = None  # the last request's keep_alive, None: the model's own
        self.engine: Engine | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{config.name}")
        self._gate = PriorityGate(1)  # hands the executor's threads to queued jobs, interactive ones first
        self._cancels: dict[str, CancelFlag] = {}
        # cancels that came before their job: the job and its cancel arrive on different subscriptions, so a
        # client that leaves at once can be heard before its job (bounded: oldest forgotten first)
        self._early_cancels: dict[str, None] = {}
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task] = set()
        self.blobs = BlobProxy(bus)  # a node reaches blobs only through the gateway's blob service, by name
        self._pullers: list[PartPuller] = []
        self.settled = asyncio.Event()  # its load ended (either way), or it was dropped: handed-over jobs stop waiting
        self._intake: list[Any] = []  # its op subscriptions, which a replace keeps open (handover.py)
        self._successor: EngineHost | None = None  # what replaces it on purpose: new jobs wait for it, run there
        self._predecessor: EngineHost | None = None  # what it replaces: its intake closes once this one listens

    def status(self) -> EngineStatus:
        stats = self.engine.stats() if self.engine is not None and self.state == "ready" else {}
        if stats.get("slots"):  # jobs beyond the slots wait in this worker's queue, not in the server's
            stats["queued"] = max(int(stats.get("queued") or 0), self.in_flight - int(stats["slots"]))
        return EngineStatus(
            engine_id=self.engine_id,
            model=self.config.name,
            engine=self.config.engine,
            ops=[] if self.member else self.config.serves(),  # a Ray member answers nothing itself
            state=self.state,
            in_flight=self.in_flight,
            served=self.served,
            error=self.error,
            warning=self.engine.warning if self.engine is not None else "",
            idle_s=0.0 if self.in_flight else round(time.monotonic() - self.used_at, 3),
            keep_alive_s=self.keep_alive_s,
            memory=self.placed_bytes,
            devices=list(self.config.devices),
            **stats,
        )

    @functools.cached_property
    def placed_bytes(self) -> int:
        """What the scheduler placed this copy for (sizing's estimate of its config), worked out once."""
        return estimate_bytes(self.config)

    async def load(self) -> bool:
        """Load the model in the engine thread, then subscribe to its ops. False if loading failed."""
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        try:
            cfg = self.config  # kept as assigned: the worker compares it with the next assignment
            try:  # from the bus, checked like input from the internet: the family's params, typed, in range
                engine_params.check(cfg.engine, cfg.params, operator=True)  # EXEC ones: the worker's _trusted
            except engine_params.ParamError as exc:
                raise EngineLoadError(f"refused: {exc.message}") from None
            if self.models_dir is not None and self.weights is not None:
                cfg = await ensure_weights(
                    cfg, bus_request(self.bus), self.models_dir, self.weights, self._fetch_event, self.node_id
                )
                t0 = time.monotonic()  # load_s is the engine's own load, not the fetch
            if cfg.shards is not None and cfg.engine in GGUF_FAMILIES:  # llama-server over other nodes' RPC servers
                from coderai.engine_worker.engines.llama_split import SplitServerEngine

                self.engine = SplitServerEngine(cfg)
            elif cfg.shards is not None and cfg.shards.mode == "ray":  # vLLM ranks over several nodes
                from coderai.engine_worker.engines.vllm_ray import RayMember, VllmRayEngine

                serving = cfg.shards.devices[0].node_id == self.node_id
                self.engine = VllmRayEngine(cfg) if serving else RayMember(cfg, self.node_id)
            elif cfg.shards is not None and cfg.shards.mode == "ranks":  # SGLang's ranks over several nodes
                from coderai.engine_worker.engines.sglang import SGLangEngine, SGLangMember

                serving = cfg.shards.devices[0].node_id == self.node_id
                self.engine = SGLangEngine(cfg, self.node_id) if serving else SGLangMember(cfg, self.node_id)
            else:
                cfg = resolve(cfg)
                if cfg.share_cache is None and not self.share_cache:  # private by this node's default
                    cfg = msgspec.structs.replace(cfg, share_cache=False)
                self.engine = engine_class(cfg.engine)(cfg)

            def lost(why: str) -> None:
                loop.call_soon_threadsafe(self._lost, why)

            def back() -> None:
                loop.call_soon_threadsafe(self._back)

            self.engine.on_lost, self.engine.on_back = lost, back
            if self.engine.max_concurrency > 1:  # an engine that batches by itself (vLLM) takes jobs side by side
                self._executor = ThreadPoolExecutor(
                    self.engine.max_concurrency, thread_name_prefix=f"engine-{self.config.name}"
                )
                self._gate = PriorityGate(self.engine.max_concurrency)
            await loop.run_in_executor(self._executor, self.engine.load)
        except EngineLoadError as exc:
            self.state, self.error = "failed", str(exc)
            log.error("load of %s failed: %s", self.config.name, exc)
            await self.let_go()
            return False
        self.load_s = time.monotonic() - t0
        self.used_at = time.monotonic()
        await self.subscribe()
        self.state = "ready"
        self.settled.set()
        log.info("loaded %s as %s in %.2fs", self.config.name, self.engine_id, self.load_s)
        return True

    async def _fetch_event(self, evt: ModelFetch) -> None:
        await self.bus.publish(EVT_MODEL_FETCH, evt, node_id=self.node_id)

    @property
    def member(self) -> bool:
        return bool(getattr(self.engine, "member", False))

    async def subscribe(self) -> None:
        """Subscribe this engine's subjects (nats-py renews them by itself after a reconnect)."""
        if self.member:
            return
        self._subs = [
            await self.bus.serve_stream(
                ENGINE_OPS[op],
                self._job(op),
                spawn=self._admit,
                queue=handover.INTAKE_QUEUE,  # shared with the host it replaces, while both listen
                subject_str=ENGINE_OPS[op](node_id=self.node_id, engine_id=self.engine_id),
            )
            for op in self.config.serves()
            if op in ENGINE_OPS
        ]
        self._intake = list(self._subs)
        if stage_host.serves_stages(self):  # a relayed video's stages (the cancel subscription stays last)
            self._subs.append(await stage_host.subscribe(self))
        self._subs.append(
            await self.bus.listen(
                ENGINE_CANCEL,
                self._on_cancel,
                subject_str=ENGINE_CANCEL(node_id=self.node_id, engine_id=self.engine_id),
            )
        )
        # batch lines come whole, so a model that is never split still pulls them; fan-out parts only when split
        queued = BATCH_OPS | (FANOUT_OPS if self.config.distribute.enabled else frozenset())
        self._pullers = [PartPuller(self, op) for op in self.config.serves() if op in queued]
        for p in self._pullers:
            p.start()
        old, self._predecessor = self._predecessor, None
        if old is not None:  # this one listens now: the intake the replaced host kept open for it closes
            await old._unsubscribe()

    async def _stop_pullers(self) -> None:
        for p in self._pullers:
            await p.stop()
        self._pullers = []

    def _lost(self, why: str) -> None:
        """The engine lost its devices: take nothing new (callers get no responder, then a clear 503), report it
        failed in the heartbeat, and wait to be re-placed."""
        if self.state not in ("ready", "draining"):
            return
        self.state, self.error = "failed", why
        self.spawn(self._drop_intake())

    def _back(self) -> None:
        """The engine serves again by itself (its devices came back): take jobs again."""
        if self.state != "failed":
            return
        self.spawn(self._resume_intake())

    async def _resume_intake(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        await self.subscribe()
        self.state, self.error = "ready", None

    async def _drop_intake(self) -> None:
        await self._stop_pullers()
        for sub in self._subs[:-1]:  # keep the cancel subscription: running jobs may still be cancelled
            await sub.unsubscribe()
        self._subs, self._intake = self._subs[-1:], []

    async def pause(self) -> None:
        """Drain: take no new jobs (jobs already here finish); the router stops sending on the next heartbeat."""
        if self.state != "ready":
            return
        self.state = "draining"
        await self._drop_intake()

    async def resume(self) -> None:
        if self.state == "draining":
            await self._resume_intake()

    async def abort_load(self) -> None:
        """A load in progress stopped: the engine closed from a thread of its own (its executor's thread is busy
        loading), which stops a server child that is still starting."""
        self.state = "unloading"
        await self.let_go()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)

    async def let_go(self) -> None:
        """Its load ended, or it is dropped: jobs handed over to it stop waiting, and the intake of the host it
        replaces closes (an idempotent step)."""
        self.settled.set()
        old, self._predecessor = self._predecessor, None
        if old is not None:
            await old._unsubscribe()

    async def _unsubscribe(self, keep: list[Any] | None = None) -> None:
        for sub in self._subs:
            if keep is None or sub not in keep:
                try:
                    await sub.unsubscribe()
                except Exception:  # connection may be gone at shutdown
                    pass
        self._subs = list(keep or [])

    async def unload(self, timeout_s: float, successor: EngineHost | None = None) -> None:
        """Stop intake, let in-flight jobs finish (bounded), then free the model. `successor`: the host that replaces
        it on purpose (its model reloaded with other params): the intake stays open meanwhile, and a job that comes
        waits for the successor to load and runs there (handover.py)."""
        self.state = "unloading"
        await self.let_go()
        if successor is not None:
            self._successor, successor._predecessor = successor, self
        await self._stop_pullers()
        cancels = self._subs[-1:]  # the cancel subscription stays while jobs finish: they may still be cancelled
        await self._unsubscribe(cancels + (self._intake if successor is not None else []))
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            for flag in self._cancels.values():
                flag.set()
            for t in pending:
                t.cancel()
        if successor is None:  # else its successor closes the rest once it listens (or its load ends)
            await self._unsubscribe()
        if self.engine is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.close)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def spawn(self, coro: Any) -> None:
        """Run `coro` as a task of this engine: unloading waits for it (bounded), then cancels it."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def expected_wait_s(self, jobs: int) -> float:
        """How long a job arriving now, with `jobs` running or queued, waits for a slot: the jobs ahead of it per
        slot times the recent time a job held a slot (0 before any job ran: nothing to go by)."""
        slots = max(1, getattr(self.engine, "max_concurrency", 1))
        return max(0, jobs + 1 - slots) / slots * self.service_s

    def _admit(self, coro: Any) -> None:
        """Start a job (`Bus.serve_stream`'s spawn), or refuse it as `busy`: when its expected wait for a slot is
        past the model's queue-time budget (`queue_time_s`), or its queue is at the engine's hard limit. The
        refusal carries the expected wait, which the client gets as `Retry-After`. Replaced on purpose, it hands
        the job to its successor (handover.py)."""
        if self._successor is not None:
            handover.admit(self._successor, getattr(self.engine, "queue_limit", 0), coro)
            return
        jobs = len(self._tasks)
        limit = getattr(self.engine, "queue_limit", 0)
        if limit and jobs >= limit:  # a bounded queue: beyond it the client is told to slow down
            raise BusError(
                "busy",
                f"{self.config.name} is busy: {limit} requests are running or queued on {self.engine_id}",
                retryable=True,
                retry_after_s=self.expected_wait_s(jobs),
            )
        budget = self.config.queue_time_s or DEFAULT_QUEUE_TIME_S
        if (wait := self.expected_wait_s(jobs)) > budget:
            raise BusError(
                "busy",
                f"{self.config.name} is busy: a request now would wait about {wait:.0f} s for a "
                f"slot of {self.engine_id}, past its queue-time budget of {budget:g} s "
                "(queue_time_s)",
                retryable=True,
                retry_after_s=wait,
            )
        self.spawn(coro)

    def _job(self, op: str) -> Any:
        """The `serve_stream` handler of one op: the job runs with the request id and trace context of its headers."""

        async def handle(job: Any, writer: FrameWriter, m: Msg) -> None:
            if (successor := self._successor) is not None:  # replaced on purpose: it waits for the new engine
                await handover.run_after_load(self, successor, op, job, writer, m.headers or {})
            else:
                await self._run(op, job, writer, m.headers or {})

        return handle

    async def _on_cancel(self, req: CancelJob, _m: Msg) -> None:
        flag = self._cancels.get(req.request_id)
        if flag is None:
            if len(self._early_cancels) >= EARLY_CANCELS:
                self._early_cancels.pop(next(iter(self._early_cancels)))
            self._early_cancels[req.request_id] = None
            return
        log.info("cancel", extra={"request_id": req.request_id})
        flag.set()

    async def _run(
        self, op: str, job: Any, writer: FrameWriter, headers: dict[str, str], give_back: bool = False
    ) -> JobOutcome:
        """Run one job, its frames to `writer`: "ok", or "failed" once an error was answered. With `give_back`
        (a fan-out part that another worker may still take) an engine failure is not answered: "retry". The
        request id is the one in `headers` (HDR_REQUEST_ID), else the job's."""
        request_id: str = headers[HDR_REQUEST_ID] if HDR_REQUEST_ID in headers else job.request_id
        engine = self.engine
        assert engine is not None, "a job comes only once its engine is loaded (its ops are subscribed then)"
        request_id_var.set(request_id)
        if HDR_KEEP_ALIVE in headers:  # as Ollama: the latest request says how long its model stays loaded idle
            self.keep_alive_s = keep_alive_header(headers[HDR_KEEP_ALIVE], self.keep_alive_s)
        if op == "chat" and not job.messages:  # Ollama's load and unload idioms: the model is loaded (this engine
            # answers), and the request's keep-alive above says how long it stays; nothing to generate
            await writer.send(Final(seq=writer.next_seq(), engine_id=self.engine_id, choices=[], usage=Usage()))
            return "ok"
        if op in LLM_OPS and (refused := unhonoured(engine, job)) is not None:
            await writer.send(
                ErrorReply(code="bad_request", message=str(refused), param=refused.param, seq=writer.next_seq())
            )
            return "failed"
        span = tracing.NO_SPAN
        if tracing.enabled():  # a child of the gateway's engine call, through the job's traceparent header
            span = tracing.start_span(
                f"engine.{op}",
                headers=headers,
                kind="server",
                attributes={
                    "coderai.request_id": request_id,
                    "coderai.engine_id": self.engine_id,
                    "coderai.model": job.model,
                    "coderai.stream": job.stream,
                },
            )
        flag = self._cancels[job.request_id] = CancelFlag()
        if self._early_cancels and job.request_id in self._early_cancels:  # its caller left before it came
            del self._early_cancels[job.request_id]
            log.info("cancel", extra={"request_id": job.request_id})
            flag.set()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        t0 = time.monotonic()
        ttft: float | None = None
        self.in_flight += 1
        log.debug("%s job started", op)

        media = op not in LLM_OPS
        if media:  # bytes come inline for the engine, whatever size they were sent at
            # first, a frame: the caller learns the job arrived while a large upload is fetched from the store
            await writer.keepalive(True)
            try:
                job = await self.blobs.unpack(job)
            except BlobMissing as exc:
                await writer.send(ErrorReply(code="bad_request", message=str(exc), seq=writer.next_seq()))
                self._finish_job(job, span)
                return "failed"

            def emit(**fields: Any) -> None:  # data=bytes for speech, progress=0..1 for long jobs
                if fields.get("progress") is not None:
                    fields["progress"] = float(fields["progress"])  # engines compute it with numpy
                loop.call_soon_threadsafe(queue.put_nowait, fields)

            sink: Any = emit
        else:

            def emit_llm(
                delta: dict | None, text: str | None, finish: str | None, logprobs: dict | None = None, index: int = 0
            ) -> None:
                item = {"delta": delta, "text": text, "finish_reason": finish}
                if logprobs:
                    item["logprobs"] = logprobs
                if index:
                    item["index"] = index
                loop.call_soon_threadsafe(queue.put_nowait, item)

            sink = emit_llm if job.stream else None

        fn = getattr(engine, op)
        started = threading.Event()  # set when an engine thread takes the job: before that it is queued

        def run(*args: Any) -> Any:
            started.set()
            if flag and not media:  # its caller gave up while it waited for a slot: nothing to run
                return [], Usage()
            began = time.monotonic()
            try:
                return fn(*args)
            finally:  # a float written whole from the engine's thread: no lock needed
                took = time.monotonic() - began
                self.service_s = took if not self.service_s else 0.8 * self.service_s + 0.2 * took

        if engine.blocking:
            fut = asyncio.ensure_future(self._gated(getattr(job, "priority", 0), run, job, flag, sink))
        else:
            fut = loop.create_future()
            try:
                fut.set_result(run(job, flag, sink))
            except Exception as exc:  # delivered below exactly as a thread's failure would be
                fut.set_exception(exc)
        fut.add_done_callback(lambda _: queue.put_nowait(DONE))

        async def forward(item: dict) -> None:
            nonlocal ttft
            if ttft is None:
                ttft = time.monotonic() - t0
            await writer.send(Chunk(seq=writer.next_seq(), **item))

        try:
            await pump(queue, writer, self.keepalive_s, forward, queued=lambda: not started.is_set())
            if media:
                output, usage = fut.result()
                output, choices = await self.blobs.pack(output), []
            else:
                (choices, usage), output = fut.result(), None
            if ttft is None:
                ttft = time.monotonic() - t0
            await writer.send(
                Final(
                    seq=writer.next_seq(),
                    engine_id=self.engine_id,
                    choices=choices,
                    output=output,
                    usage=usage,
                    ttft_s=ttft,
                )
            )
            self.served += 1
            if span is not tracing.NO_SPAN:
                span.set_attributes(
                    {
                        "coderai.prompt_tokens": usage.prompt_tokens,
                        "coderai.completion_tokens": usage.completion_tokens,
                        "coderai.ttft_s": ttft,
                    }
                )
            return "ok"
        except ValueError as exc:  # BadInput, or llama-cpp-python's word for a prompt it cannot take (> n_ctx)
            tracing.set_error(span, f"bad_request: {exc}")
            await writer.send(
                ErrorReply(
                    code="bad_request", message=str(exc), seq=writer.next_seq(), param=getattr(exc, "param", None)
                )
            )
            return "failed"
        except EngineLost as exc:  # the devices went away: another engine (after re-placement) may serve it
            log.error("%s job lost its engine: %s", op, exc)
            tracing.set_error(span, f"no_engine: {exc}")
            if give_back:
                return "retry"
            await writer.send(ErrorReply(code="no_engine", message=str(exc), retryable=True, seq=writer.next_seq()))
            return "failed"
        except Exception as exc:  # outermost edge of a job: log it, answer typed
            log.exception("%s job failed", op)
            tracing.set_error(span, f"engine_failed: {type(exc).__name__}: {exc}")
            if give_back:
                return "retry"
            await writer.send(
                ErrorReply(code="engine_failed", message=f"{type(exc).__name__}: {exc}", seq=writer.next_seq())
            )
            return "failed"
        finally:
            if not fut.done():
                flag.set()
            self._finish_job(job, span)

    async def _gated(self, priority: int, fn: Any, *args: Any) -> Any:
        """`fn(*args)` in an engine thread once the gate gives this job a slot (interactive jobs before background
        ones); the slot is handed on when it ends."""
        await self._gate.acquire(priority)
        done = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        done.add_done_callback(lambda _: self._gate.release())  # when the thread is free, even if this was cancelled
        return await done

    def _finish_job(self, job: Any, span: Any) -> None:
        self.in_flight -= 1
        self.used_at = time.monotonic()
        self._cancels.pop(job.request_id, None)
        span.end()
