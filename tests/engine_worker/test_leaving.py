"""A worker told to stop (SIGTERM: its operator, `docker compose down`, RunPod taking a spot pod back) says so
before it goes: its heartbeats from then on say it is leaving, the first with every engine draining, so the routers stop sending it work at once
instead of a heartbeat timeout later (and the pod broker bills a preempted pod to that moment:
tests/integration/test_pods.py). A job sent after that finds no engine."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from coderai.contracts import BusError, ChatJob, Final, Frame, Heartbeat, ModelConfig, SamplingParams, decode
from coderai.contracts.subjects import ENGINE_CHAT, HEARTBEAT
from coderai.engine_worker.host import engine_id_for
from coderai.testing.procs import ServiceProcess, deadline_scale
from coderai.testing.stack import clean_env

pytestmark = pytest.mark.slow


async def test_a_stopping_worker_heartbeats_its_engines_draining_then_takes_no_job(nats_server, bus, tmp_path, unique):
    node = f"leaving-{unique}"
    model = ModelConfig(name=f"echo-{unique}", engine="echo", path="-", params={"reply": "hi"})
    beats: list[Heartbeat] = []
    heard = asyncio.Event()

    async def on_hb(hb: Heartbeat, _m) -> None:
        beats.append(hb)
        heard.set()

    await bus.listen(HEARTBEAT, on_hb, subject_str=HEARTBEAT(node_id=node))
    env = clean_env(
        CODERAI_NATS_URL=nats_server.url,
        CODERAI_NODE_ID=node,
        CODERAI_WORKER_MODELS_JSON=json.dumps([msgspec.to_builtins(model)]),  # fixed models, as a pod has
        CODERAI_WORKER_MDNS="false",
        CODERAI_WORKER_FAMILIES="echo",
        CODERAI_WORKER_HEARTBEAT_S="0.2",
        CODERAI_DATA_DIR=str(tmp_path / "data"),
    )
    proc = ServiceProcess(node, "coderai.engine_worker", [], env, tmp_path / "logs").start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60 * deadline_scale()
        while not any(e.state == "ready" for b in beats for e in b.engines):
            assert proc.alive() and loop.time() < deadline, proc.log_text()[-3000:]
            heard.clear()
            await asyncio.wait_for(heard.wait(), 60 * deadline_scale())
        proc.terminate()
        assert await asyncio.to_thread(proc.reap) == 0, proc.log_text()[-3000:]
    finally:
        proc.stop()
    await bus.nc.flush()
    said = next(i for i, b in enumerate(beats) if b.leaving)
    first = beats[said]  # at once, with every engine it had draining; all after it (the unloads) say it too
    assert first.engines and all(e.state == "draining" for e in first.engines), first
    assert all(b.leaving for b in beats[said:]) and not any(b.leaving for b in beats[:said])
    assert any(e.state == "ready" for b in beats[:said] for e in b.engines)
    assert not beats[-1].engines  # the last: everything unloaded
    job = ChatJob(
        request_id="after",
        model=model.name,
        messages=[{"role": "user", "content": "hello"}],
        params=SamplingParams(max_tokens=2),
    )
    with pytest.raises(BusError) as gone:  # what a router that missed the heartbeat would meet: no engine, at once
        stream = await bus.open_stream(
            ENGINE_CHAT, job, idle_timeout_s=10.0, node_id=node, engine_id=engine_id_for(node, model.name)
        )
        while not isinstance(decode(await stream.next_raw(), Frame), Final):
            pass
    assert gone.value.code == "no_engine"
