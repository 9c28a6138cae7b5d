"""The request pipeline (`gateway/pipeline.py`) over a real nats-server and Redis, with a router and engines that
live in the test: failover before the first frame, an engine error mid-stream, a client that leaves (streamed
and whole), an oversize body, and one `request.completed` on every path."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import Counter

import pytest
import redis.asyncio as aioredis

from coderai.accounts.keys import ApiKey
from coderai.accounts.limits import period_id
from coderai.contracts import (
    BusError,
    CancelJob,
    ChatJob,
    Choice,
    Chunk,
    ErrorReply,
    Final,
    ModelConfig,
    RequestCompleted,
    RouteDecision,
    RouteRequest,
    Usage,
    encode,
    model_key,
)
from coderai.contracts.subjects import ENGINE_CANCEL, ENGINE_CHAT, EVT_REQUEST_COMPLETED, ROUTE_PICK
from coderai.contracts.topology import MODELS
from coderai.gateway.auth import Caller
from coderai.gateway.errors import ApiError, ClientGone
from coderai.gateway.pipeline import Call, answer, relay_stream
from coderai.gateway.settings import GatewaySettings
from coderai.gateway.state import Gateway
from coderai.runtime.bus import Bus, FrameWriter
from coderai.runtime.lifecycle import wait_for

PRICE = 1000.0  # USD per million tokens: a reservation is visible in Redis
ACCEPT_S = 0.3  # the gateway's accept timeout here


class Engine:
    """An engine on the bus, node `n1`, doing what the test sets in `mode` for each job it is sent."""

    def __init__(self, engine_id: str, mode: str = "answer") -> None:
        self.engine_id, self.mode = engine_id, mode
        self.jobs: list[str] = []
        self.cancelled: set[str] = set()
        self.release = asyncio.Event()
        self.speak = asyncio.Event()  # a "slow_accept" engine is silent until the gateway asked the router again

    async def start(self, bus: Bus) -> None:
        tasks: set[asyncio.Task] = set()

        def spawn(coro) -> None:
            t = asyncio.create_task(coro)
            tasks.add(t)
            t.add_done_callback(tasks.discard)

        await bus.serve_stream(
            ENGINE_CHAT, self.run, spawn=spawn, subject_str=ENGINE_CHAT(node_id="n1", engine_id=self.engine_id)
        )

        async def on_cancel(msg: CancelJob, _m) -> None:
            self.cancelled.add(msg.request_id)
            self.release.set()

        await bus.listen(ENGINE_CANCEL, on_cancel, subject_str=ENGINE_CANCEL(node_id="n1", engine_id=self.engine_id))

    async def run(self, job: ChatJob, w: FrameWriter, _msg) -> None:
        self.jobs.append(job.request_id)
        if self.mode == "slow_accept":  # silent past the gateway's accept timeout (a worker starved of CPU)
            await asyncio.wait_for(self.speak.wait(), 10)  # past the accept timeout, within the idle one
        if self.mode == "fail_first":  # retryable, before any frame: the gateway tries another engine
            await w.send(ErrorReply(seq=w.next_seq(), code="engine_failed", message="GPU fell off", retryable=True))
            return
        if job.stream or self.mode != "hang":  # a whole answer has no chunks: the gateway waits for the Final
            await w.send(Chunk(seq=w.next_seq(), delta={"content": "hi"}))
        if self.mode == "fail_mid":
            await w.send(ErrorReply(seq=w.next_seq(), code="engine_failed", message="died mid-answer"))
            return
        if self.mode == "hang":  # until the gateway cancels the job
            while not self.release.is_set():
                await w.keepalive()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.release.wait(), 0.5)
            return
        usage = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5)
        choices = [] if job.stream else [Choice(message={"role": "assistant", "content": "hi"}, finish_reason="stop")]
        await w.send(Final(seq=w.next_seq(), engine_id=self.engine_id, usage=usage, choices=choices))


class Rig:
    """A gateway's state over the bus, the router's pick (the first engine not excluded) and the events."""

    def __init__(self, gw: Gateway, engines: dict[str, Engine], redis) -> None:
        self.gw, self.engines, self.redis = gw, engines, redis
        self.events: list[RequestCompleted] = []
        self.picks: list[list[str]] = []
        self.unknown: set[str] = set()  # engines the router does not offer

    def count(self, rid: str) -> int:
        return Counter(e.request_id for e in self.events)[rid]

    async def one_event(self, rid: str) -> RequestCompleted:
        """The request's `request.completed`, after making sure no second one follows it."""
        await wait_for(lambda: self.count(rid) >= 1, 10, what=f"request.completed of {rid}")
        await self.gw.bus.nc.flush()
        [event] = [e for e in self.events if e.request_id == rid]
        return event

    def call(self, who: Caller, stream: bool = False, content: str = "hello") -> Call:
        job = ChatJob(
            request_id=secrets.token_hex(12),
            model=self.model,
            stream=stream,
            messages=[{"role": "user", "content": content}],
        )
        return Call(self.gw, who, "chat", job)

    async def reserved(self, who: Caller) -> float:
        raw = await self.redis.get(f"coderai:reserved:{who.key_name}:{period_id('month', time.time())[0]}")
        return float(raw or 0)


@pytest.fixture
async def rig(nats_server, redis_server, unique):
    settings = GatewaySettings(
        nats_url=nats_server.url,
        redis_url=redis_server.url,
        no_auth=True,
        idle_timeout_s=5.0,
        accept_timeout_s=ACCEPT_S,
        retry_after_s=3,
    )
    gw = Gateway(settings)
    async with gw.lifespan(None):
        engines = {"e1": Engine("e1"), "e2": Engine("e2")}
        side = await Bus.connect(nats_server.url, "test-side")
        for e in engines.values():
            await e.start(side)
        redis = aioredis.from_url(redis_server.url)
        r = Rig(gw, engines, redis)
        r.model = f"m-{unique}"

        async def pick(req: RouteRequest, _m) -> RouteDecision:
            r.picks.append(list(req.exclude))
            if req.exclude:  # the accept timeout passed: a silent engine may speak now
                for e in engines.values():
                    e.speak.set()
            engine = next((e for e in engines if e not in req.exclude and e not in r.unknown), None)
            if engine is None:
                raise BusError("no_engine", f"no live engine serves chat for model {req.model!r}", retryable=True)
            return RouteDecision(engine_id=engine, node_id="n1", reason="least_busy")

        await side.serve(ROUTE_PICK, pick)

        async def completed(ev: RequestCompleted, _m) -> None:
            r.events.append(ev)

        await side.listen(EVT_REQUEST_COMPLETED, completed)
        cfg = ModelConfig(
            name=r.model, engine="echo", path="", price_prompt_per_mtok=PRICE, price_completion_per_mtok=PRICE
        )
        await (await side.kv(MODELS)).put(model_key(r.model), encode(cfg))
        await wait_for(lambda: r.model in gw.catalog.models, 10, what="the catalogue to see the model")
        try:
            yield r
        finally:
            await redis.aclose()
            await side.close()


def budgeted(unique: str) -> Caller:
    key = ApiKey(name=f"k-{unique}", sha256="0" * 64, budget_usd=1000.0)
    return Caller(key.name, frozenset({"inference"}), key)


async def test_a_whole_answer_fails_over_before_the_first_frame(rig, unique):
    rig.engines["e1"].mode = "fail_first"
    who = budgeted(unique)
    call = rig.call(who)
    final = await answer(call)
    assert final.engine_id == "e2" and final.choices[0].message["content"] == "hi"
    assert rig.picks == [[], ["e1"]]  # asked again without the engine that failed
    event = await rig.one_event(call.request_id)
    assert (event.status, event.engine_id, event.prompt_tokens, event.completion_tokens) == ("ok", "e2", 3, 2)
    assert event.cost_usd == pytest.approx(5 * PRICE / 1e6)
    assert await rig.reserved(who) == pytest.approx(0.0, abs=1e-9)  # the reservation was settled


async def test_an_engine_slow_to_take_the_job_is_given_up_for_another(rig, unique):
    """An engine silent past the accept timeout may have lost the job (a NATS server died under it): with another
    engine to ask, the job goes there, and the silent one is told to stop."""
    rig.engines["e1"].mode = "slow_accept"
    call = rig.call(budgeted(unique))
    final = await answer(call)
    assert final.engine_id == "e2" and rig.picks == [[], ["e1"]]  # the router asked once more, for another engine
    await wait_for(lambda: call.request_id in rig.engines["e1"].cancelled, 10, what="the cancel of the silent job")


async def test_an_engine_slow_to_take_the_job_is_waited_for_when_no_other_can(rig, unique):
    """The only engine of the model, slow to say it has the job (its worker starved of CPU by its engine, as a
    vLLM answer on a loaded 2-core machine does), still answers: the gateway does not give up the one engine that
    can, it waits the idle timeout for it."""
    rig.unknown = {"e2"}
    rig.engines["e1"].mode = "slow_accept"
    call = rig.call(budgeted(unique))
    final = await answer(call)
    assert final.engine_id == "e1" and final.choices[0].message["content"] == "hi"
    assert rig.picks == [[], ["e1"]]  # asked whether another engine could take it: none
    assert call.request_id not in rig.engines["e1"].cancelled
    event = await rig.one_event(call.request_id)
    assert (event.status, event.engine_id) == ("ok", "e1")


async def test_an_error_mid_stream_ends_the_sse_with_an_error_event(rig, unique):
    rig.engines["e1"].mode = "fail_mid"
    who = budgeted(unique)
    call = rig.call(who, stream=True)
    await call.admit()
    first = await call.open()

    async def done(frame) -> bytes:
        return b"done "

    pieces = [
        p
        async for p in relay_stream(
            call, first, lambda f: b"chunk ", done, error=lambda err: f"error {err.status}".encode()
        )
    ]
    assert pieces == [b"chunk ", b"error 502"]
    event = await rig.one_event(call.request_id)
    assert (event.status, event.http_status, event.stream) == ("engine_failed", 502, True)
    assert await rig.reserved(who) == pytest.approx(0.0, abs=1e-9)


async def test_an_error_mid_answer_is_a_502_accounted_once(rig, unique):
    rig.engines["e1"].mode = "fail_mid"
    call = rig.call(budgeted(unique))
    with pytest.raises(ApiError) as exc:
        await answer(call)
    assert exc.value.status == 502 and exc.value.code == "engine_failed"
    event = await rig.one_event(call.request_id)
    assert (event.status, event.http_status, event.engine_id) == ("engine_failed", 502, "e1")


class Client:
    """What `answer` reads of a request after its body: the ASGI receive, which says when the client leaves."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def test_a_client_leaving_a_whole_answer_cancels_the_engine_job(rig, unique):
    engine = rig.engines["e1"]
    engine.mode = "hang"
    who = budgeted(unique)
    call, client = rig.call(who), Client()
    task = asyncio.create_task(answer(call, client))
    await wait_for(lambda: call.request_id in engine.jobs, 10, what="the engine to get the job")
    assert await rig.reserved(who) > 0  # held while it runs
    client.gone.set()
    with pytest.raises(ClientGone):  # not the cancellation itself: the HTTP server would log that as a crash
        await task
    await wait_for(lambda: call.request_id in engine.cancelled, 10, what="the engine to be told to cancel")
    event = await rig.one_event(call.request_id)
    assert (event.status, event.http_status) == ("cancelled", 499)
    assert await rig.reserved(who) == pytest.approx(0.0, abs=1e-9)


async def test_a_client_leaving_a_stream_cancels_the_engine_job(rig, unique):
    engine = rig.engines["e1"]
    engine.mode = "hang"
    call = rig.call(budgeted(unique), stream=True)
    await call.admit()
    first = await call.open()

    async def done(frame) -> bytes:
        return b"done"

    pieces = relay_stream(call, first, lambda f: b"x", done)
    assert await pieces.__anext__() == b"x"
    await pieces.aclose()  # what the HTTP server does when the client goes
    await wait_for(lambda: call.request_id in engine.cancelled, 10, what="the engine to be told to cancel")
    event = await rig.one_event(call.request_id)
    assert (event.status, event.http_status, event.stream) == ("cancelled", 499, True)


async def test_a_body_the_bus_cannot_carry_is_a_413_before_any_reservation(rig, unique):
    who = budgeted(unique)
    limit = rig.gw.bus.nc.max_payload
    call = rig.call(who, content="x" * (limit + 1))
    with pytest.raises(ApiError) as exc:
        await answer(call)
    assert exc.value.status == 413 and exc.value.code == "request_too_large"
    assert await rig.reserved(who) == 0.0  # nothing was held, so nothing is left held
    assert rig.engines["e1"].jobs == [] and rig.picks == []
    await rig.gw.bus.nc.flush()
    assert rig.count(call.request_id) == 0  # refused at the door, like a 429: never admitted, never completed


async def test_every_path_accounts_exactly_once(rig, unique):
    """A mix of the paths above, run together: each request has exactly one event."""
    modes = ["answer", "fail_mid"]
    calls = []
    for i in range(6):
        rig.engines["e1"].mode = modes[i % 2]
        call = rig.call(budgeted(unique))
        calls.append(call)
        with contextlib.suppress(ApiError):
            await answer(call)
    for call in calls:
        await rig.one_event(call.request_id)
    assert all(rig.count(c.request_id) == 1 for c in calls)


async def test_a_publish_the_bus_does_not_ack_is_a_503_with_retry_after(rig, unique):
    """A fan-out part's publish times out while NATS restarts or its disk is full: a 503 the client may retry,
    accounted once, its reservation released; not a 500."""
    from nats.errors import TimeoutError as NatsTimeout

    who = budgeted(unique)
    call = rig.call(who)
    await call.admit()
    err = await call.fail(NatsTimeout())
    assert isinstance(err, ApiError) and (err.status, err.code) == (503, "bus_unavailable")
    assert int(err.headers["Retry-After"]) > 0
    event = await rig.one_event(call.request_id)
    assert (event.status, event.http_status) == ("bus_unavailable", 503)
    assert await rig.reserved(who) == 0.0


def test_a_models_stop_sequences_join_the_requests_own_and_its_limits_apply():
    from coderai.contracts import SamplingParams
    from coderai.gateway.pipeline import output_limited

    cfg = ModelConfig(name="base", engine="llama-server", path="-", stop=["\n\n", "User:"], max_output_tokens=64)
    job = ChatJob(
        request_id="r",
        model="base",
        messages=[{"role": "user", "content": "hi"}],
        params=SamplingParams(stop=["User:", "END"], max_tokens=32000),
    )
    limited = output_limited(job, cfg)
    assert limited.params.stop == ["User:", "END", "\n\n"] and limited.params.max_tokens == 64
    plain = ModelConfig(name="base", engine="llama-server", path="-")
    assert output_limited(job, plain) is job  # nothing to apply: the same job


def test_a_keys_output_limits_apply_beside_the_models_the_lower_ceiling_wins():
    from coderai.contracts import SamplingParams
    from coderai.gateway.pipeline import output_limited

    cfg = ModelConfig(name="m", engine="llama-server", path="-", default_output_tokens=512, max_output_tokens=4096)
    key = ApiKey(name="ui", sha256="x", default_output_tokens=64, max_output_tokens=256)

    def asked(n):
        job = ChatJob(
            request_id="r", model="m", messages=[{"role": "user", "content": "hi"}], params=SamplingParams(max_tokens=n)
        )
        return output_limited(job, cfg, key).params.max_tokens

    assert (asked(None), asked(100), asked(32000)) == (64, 100, 256)
    loose = ApiKey(name="agent", sha256="y", max_output_tokens=100_000)  # the model's ceiling is lower
    job = ChatJob(request_id="r", model="m", messages=[], params=SamplingParams(max_tokens=32000))
    assert output_limited(job, cfg, loose).params.max_tokens == 4096
    assert (
        output_limited(
            ChatJob(request_id="r", model="m", messages=[]), cfg, ApiKey(name="k", sha256="z")
        ).params.max_tokens
        == 512
    )  # a key without limits: the model's
