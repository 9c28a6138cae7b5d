"""A model reloaded with new params (a deliberate replace of its engine, not a crash): a streamed request in
flight on the old engine finishes whole, and a request that comes while the new one loads waits for it (queued,
with keep-alives) and is answered by it. A real worker converging on real assignments, with the echo engine
paced by `token_delay_s` (a slow-streaming engine in the worker, no model)."""

from __future__ import annotations

import asyncio

import pytest

from coderai.contracts import Assignment, ChatJob, Chunk, ErrorReply, Final, Frame, KeepAlive, ModelConfig, decode
from coderai.contracts import SamplingParams
from coderai.contracts.subjects import ENGINE_CHAT
from coderai.engine_worker.host import EngineHost, engine_id_for
from coderai.engine_worker.service import Worker
from coderai.engine_worker.settings import WorkerSettings
from coderai.runtime.bus import Bus, FrameStream
from coderai.runtime.lifecycle import wait_for

TOKENS = 30


def _config(reply: str, delay_s: float = 0.02) -> ModelConfig:
    return ModelConfig(name="echo", engine="echo", path="-", params={"reply": reply, "token_delay_s": delay_s})


@pytest.fixture
async def worker(bus, unique):
    w = Worker(WorkerSettings(families=["echo"], drain_timeout_s=30, mdns=False), f"n{unique}")
    w.bus = bus  # its bus, as start() would connect it: the assignment is given by hand below
    yield w
    await w._unload_all()


async def _open(bus: Bus, w: Worker, rid: str, max_tokens: int = TOKENS) -> FrameStream:
    job = ChatJob(
        request_id=rid,
        model="echo",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        params=SamplingParams(max_tokens=max_tokens),
    )
    return await bus.open_stream(
        ENGINE_CHAT, job, idle_timeout_s=20, node_id=w.node_id, engine_id=engine_id_for(w.node_id, "echo")
    )


async def _rest(stream: FrameStream, frames: list) -> list:
    while not isinstance(frames[-1] if frames else None, (Final, ErrorReply)):
        frames.append(decode(await stream.next_raw(), Frame))
    stream.close()
    return frames


def _text(frames: list) -> str:
    return "".join(f.delta.get("content", "") for f in frames if isinstance(f, Chunk) and f.delta)


async def _ready(w: Worker) -> EngineHost:
    await wait_for(lambda: w.hosts.get("echo") is not None and w.hosts["echo"].state == "ready", 30, what="a load")
    return w.hosts["echo"]


async def test_a_stream_in_flight_while_its_model_is_reloaded_finishes_whole(bus, worker):
    await worker.converge(Assignment(node_id=worker.node_id, models=[_config("old")]))
    old = await _ready(worker)
    stream = await _open(bus, worker, "in-flight")
    first: list = []
    while not _text(first):  # a token came: the job runs on the old engine
        first.append(decode(await stream.next_raw(), Frame))

    reload = asyncio.create_task(worker.converge(Assignment(node_id=worker.node_id, models=[_config("new")])))
    frames = await _rest(stream, first)
    assert isinstance(frames[-1], Final), frames[-1]
    assert _text(frames) == " ".join(["old"] * TOKENS) and frames[-1].usage.completion_tokens == TOKENS
    await reload
    new = await _ready(worker)
    assert new is not old and new.config.params["reply"] == "new" and old.state == "unloading"
    after = await _rest(await _open(bus, worker, "after", max_tokens=2), [])
    assert _text(after) == "new new"


async def test_a_request_arriving_during_the_reload_waits_for_the_new_engine(bus, worker):
    await worker.converge(Assignment(node_id=worker.node_id, models=[_config("old")]))
    old = await _ready(worker)
    stream = await _open(bus, worker, "in-flight", max_tokens=5 * TOKENS)  # 3 s: the reload waits for it
    first: list = []
    while not _text(first):
        first.append(decode(await stream.next_raw(), Frame))
    reload = asyncio.create_task(worker.converge(Assignment(node_id=worker.node_id, models=[_config("new")])))
    await wait_for(lambda: old.state == "unloading", 10, what="the reload to begin")

    waiting = await _open(bus, worker, "during", max_tokens=2)  # the old engine drains; the new one is not loaded
    frames = [decode(await waiting.next_raw(), Frame)]
    assert isinstance(frames[0], KeepAlive) and frames[0].queued  # it waits, and says so
    assert old.in_flight == 1 and not old.served  # the old engine's job still runs
    frames = await _rest(waiting, frames)
    assert isinstance(frames[-1], Final), frames[-1]
    assert _text(frames) == "new new" and frames[-1].engine_id == old.engine_id
    done = await _rest(stream, first)
    assert isinstance(done[-1], Final) and done[-1].usage.completion_tokens == 5 * TOKENS
    await reload
    assert worker.hosts["echo"].served >= 1 and old.served == 1


async def test_a_request_waiting_for_a_reload_that_fails_is_told_so(bus, worker):
    await worker.converge(Assignment(node_id=worker.node_id, models=[_config("old")]))
    old = await _ready(worker)
    bad = ModelConfig(name="echo", engine="echo", path="-", params={"token_delay_s": -1.0})  # refused at load
    stream = await _open(bus, worker, "in-flight")
    first: list = []
    while not _text(first):
        first.append(decode(await stream.next_raw(), Frame))
    reload = asyncio.create_task(worker.converge(Assignment(node_id=worker.node_id, models=[bad])))
    await wait_for(lambda: old.state == "unloading", 10, what="the reload to begin")
    frames = await _rest(await _open(bus, worker, "during", max_tokens=2), [])
    assert isinstance(frames[-1], ErrorReply) and frames[-1].code == "no_engine" and frames[-1].retryable
    assert all(isinstance(f, KeepAlive) for f in frames[:-1])
    await reload
    await wait_for(lambda: worker.hosts["echo"].state == "failed", 30, what="the failed load")


@pytest.mark.slow
async def test_a_llama_server_reloaded_with_other_params_finishes_the_stream_it_serves(bus, worker, tiny_gguf):
    """The same on a real llama-server child: the old server is stopped only after its stream ended whole."""
    from coderai.engine_worker.engines import llama_server

    if llama_server.find_binary() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    worker.families.append("llama-server")

    def cfg(parallel: int) -> ModelConfig:
        params = {"parallel": parallel, "n_ctx": 2048, "n_threads": 1}
        return ModelConfig(name="echo", engine="llama-server", path=str(tiny_gguf), params=params)

    await worker.converge(Assignment(node_id=worker.node_id, models=[cfg(1)]))
    old = await _ready(worker)
    server = old.engine
    assert isinstance(server, llama_server.LlamaServerEngine)
    eos = server.post_json("/tokenize", {"content": "<|im_end|>", "parse_special": True}, "t")["tokens"]
    job = ChatJob(
        request_id="long",
        model="echo",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        params=SamplingParams(max_tokens=1500, temperature=0, logit_bias={str(eos[0]): -100.0}),  # no end of turn
    )
    stream = await bus.open_stream(ENGINE_CHAT, job, idle_timeout_s=60, node_id=worker.node_id, engine_id=old.engine_id)
    first: list = []
    while not _text(first):
        first.append(decode(await stream.next_raw(), Frame))
    reload = asyncio.create_task(worker.converge(Assignment(node_id=worker.node_id, models=[cfg(2)])))
    await wait_for(lambda: old.state == "unloading", 10, what="the reload to begin")
    assert old.in_flight == 1 and server.child.running()  # the reload waits for the stream; the server still runs
    frames = await _rest(stream, first)
    assert isinstance(frames[-1], Final), frames[-1]
    assert frames[-1].usage.completion_tokens == 1500
    await reload
    new = await _ready(worker)
    assert new.config.params["parallel"] == 2 and not server.child.running()
