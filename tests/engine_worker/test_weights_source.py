"""A worker as a rented pod runs it (a fixed assignment, no copy of the model's `path`) fetches the weights by the
model's `source` from a local server speaking the Hugging Face Hub's API: progress events on the bus, HF_TOKEN
sent and never logged, the sha256 checked before loading (a corrupted download is refused with a failed event and
never loaded), the weights kept on the "network volume" so the next pod starts warm, and the model then answers."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from coderai.contracts import ChatJob, EngineStatus, Final, Heartbeat, ModelConfig, ModelFetch, SamplingParams, decode
from coderai.contracts.jobs import Frame
from coderai.contracts.subjects import ENGINE_CHAT, EVT_MODEL_FETCH, EVT_MODEL_LOADED, HEARTBEAT
from coderai.engine_worker.host import engine_id_for
from coderai.testing.fake_hub import FakeHub, hub_env
from coderai.testing.procs import ServiceProcess, deadline_scale
from coderai.testing.stack import clean_env

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow

TOKEN = "hf_pod_secret_0123456789"
FILE = "tiny.gguf"


class Pod:
    """One worker process started as the broker starts a pod's, and what it says on the bus."""

    def __init__(self, bus, nats_url: str, hub: FakeHub, model: ModelConfig, node: str, root, volume) -> None:
        self.bus, self.node, self.model = bus, node, model
        self.fetches: list[ModelFetch] = []
        self.engine: EngineStatus | None = None
        self.changed = asyncio.Event()
        env = clean_env(
            CODERAI_NATS_URL=nats_url,
            CODERAI_NODE_ID=node,
            CODERAI_WORKER_POD=node,
            CODERAI_WORKER_MODELS_JSON=json.dumps([msgspec.to_builtins(model)]),
            CODERAI_WORKER_MDNS="false",
            CODERAI_WORKER_FAMILIES="llama",
            CODERAI_WORKER_HEARTBEAT_S="0.3",
            CODERAI_DATA_DIR=str(root / node),
            CODERAI_WORKER_WEIGHTS_DIR=str(volume),
            HF_TOKEN=TOKEN,
            **hub_env(hub, str(root / node / "hf")),
        )
        self.proc = ServiceProcess(node, "coderai.engine_worker", [], env, root / "logs")

    async def start(self) -> Pod:
        async def on_fetch(evt: ModelFetch, _m) -> None:
            self.fetches.append(evt)
            self.changed.set()

        async def on_hb(hb: Heartbeat, _m) -> None:
            self.engine = next((e for e in hb.engines if e.model == self.model.name), None)
            self.changed.set()

        await self.bus.listen(EVT_MODEL_FETCH, on_fetch, subject_str=EVT_MODEL_FETCH(node_id=self.node))
        await self.bus.listen(HEARTBEAT, on_hb, subject_str=HEARTBEAT(node_id=self.node))
        self.proc.start()
        return self

    async def until(self, what: str, predicate, timeout_s: float = 60.0) -> None:
        """Wait on the bus (each event or heartbeat wakes it) until `predicate()`, or fail naming `what`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s * deadline_scale()
        while not predicate():
            assert self.proc.alive(), f"{self.node} died:\n{self.proc.log_text()[-3000:]}"
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), max(0.0, min(1.0, deadline - loop.time())))
            except asyncio.TimeoutError:
                if loop.time() >= deadline:
                    raise AssertionError(
                        f"{self.node}: no {what} in {timeout_s}s; events {self.fetches}, engine "
                        f"{self.engine}\n{self.proc.log_text()[-3000:]}"
                    ) from None

    async def ready(self) -> None:
        await self.until("ready engine", lambda: self.engine is not None and self.engine.state in ("ready", "failed"))
        assert self.engine.state == "ready", f"{self.engine.error}\n{self.proc.log_text()[-3000:]}"

    async def chat(self) -> Final:
        job = ChatJob(
            request_id="r1",
            model=self.model.name,
            messages=[{"role": "user", "content": "hello"}],
            params=SamplingParams(max_tokens=4, temperature=0.0),
        )
        stream = await self.bus.open_stream(
            ENGINE_CHAT,
            job,
            idle_timeout_s=30.0,
            node_id=self.node,
            engine_id=engine_id_for(self.node, self.model.name),
        )
        try:
            while not isinstance(frame := decode(await stream.next_raw(), Frame), Final):
                pass
        finally:
            stream.close()
        return frame

    def stop(self) -> None:
        self.proc.stop()


@pytest.fixture
def hub(tiny_gguf):
    hub = FakeHub()
    hub.add("acme/tiny-GGUF", {FILE: tiny_gguf.read_bytes()})
    yield hub
    hub.close()


def model(unique: str) -> ModelConfig:
    return ModelConfig(
        name=f"tiny-{unique}",
        engine="llama",
        path="/nowhere/on/the/pod/tiny.gguf",
        source="hf://acme/tiny-GGUF/tiny.gguf@main",
        params={"n_ctx": 256, "seed": 1},
    )


async def test_a_pod_fetches_its_weights_by_source_verifies_them_and_serves(
    nats_server, bus, hub, tiny_gguf, tmp_path, unique
):
    volume = tmp_path / "runpod-volume" / "models"
    m = model(unique)
    pod = await Pod(bus, nats_server.url, hub, m, f"pod-a-{unique}", tmp_path, volume).start()
    loaded = asyncio.Event()

    async def on_loaded(_evt, _m) -> None:
        loaded.set()

    await bus.listen(EVT_MODEL_LOADED, on_loaded, subject_str=EVT_MODEL_LOADED(node_id=pod.node))
    try:
        await pod.ready()
        await asyncio.wait_for(loaded.wait(), 10 * deadline_scale())
        size = tiny_gguf.stat().st_size
        states = [e.state for e in pod.fetches]
        assert states[0] == "resolving" and states[-1] == "done" and "failed" not in states, states
        assert states.index("downloading") < states.index("verifying") < states.index("done")
        assert all(e.source == m.source and e.model == m.name and e.node_id == pod.node for e in pod.fetches)
        done = pod.fetches[-1]
        assert (done.bytes_done, done.bytes_total) == (size, size)
        assert [e.file for e in pod.fetches if e.state == "verifying"] == [FILE]
        kept = volume / "acme" / "tiny-GGUF" / FILE  # on the volume, the next pod's
        assert kept.read_bytes() == tiny_gguf.read_bytes()
        assert ("GET", f"/acme/tiny-GGUF/resolve/main/{FILE}", "") in hub.requests
        assert hub.tokens == {TOKEN}  # HF_TOKEN went to the Hub
        final = await pod.chat()
        assert final.usage is not None and final.usage.completion_tokens > 0
    finally:
        pod.stop()
    assert TOKEN not in pod.proc.log_text() and "tiny" in pod.proc.log_text()

    hub.requests.clear()  # the next pod on the same volume: the file is there and verified, so nothing is downloaded
    warm = await Pod(bus, nats_server.url, hub, m, f"pod-b-{unique}", tmp_path, volume).start()
    try:
        await warm.ready()
        assert [e.state for e in warm.fetches][-1] == "done"
        assert not [r for r in hub.requests if r[0] == "GET" and r[1].endswith(FILE)], hub.requests
        assert (await warm.chat()).usage is not None
    finally:
        warm.stop()


async def test_a_corrupted_download_is_refused_and_never_loaded(nats_server, bus, hub, tmp_path, unique):
    hub.corrupt.add(FILE)  # the right headers (size, sha256), the wrong bytes
    volume = tmp_path / "volume"
    pod = await Pod(bus, nats_server.url, hub, model(unique), f"pod-c-{unique}", tmp_path, volume).start()
    try:
        await pod.until("failed engine", lambda: pod.engine is not None and pod.engine.state == "failed")
        [failed] = [e for e in pod.fetches if e.state == "failed"]
        assert "checksum mismatch" in failed.error and FILE in failed.error
        assert (
            "checksum mismatch" in (pod.engine.error or "") and "hf://acme/tiny-GGUF/tiny.gguf@main" in pod.engine.error
        )
        assert "done" not in [e.state for e in pod.fetches]
        assert not (volume / "acme" / "tiny-GGUF" / FILE).exists()  # deleted, not kept for the next pod
    finally:
        pod.stop()
