"""End to end over a real NATS bus, no namespaces: the head's scheduler serves its model store (listing and ranges),
and a worker holding only the node's credentials fetches a model folder and a file inside one through it."""

from __future__ import annotations

import asyncio
import contextlib
import os

import msgspec
import pytest
from coderai.contracts import Assignment, ModelConfig, encode
from coderai.engine_worker.fetch import FetchError, bus_request, ensure_local
from coderai.runtime.bus import Bus
from coderai.runtime.embedded import NatsServer
from coderai.runtime.members import node_inbox
from coderai.scheduler.service import Scheduler
from coderai.scheduler.settings import SchedulerSettings


@pytest.fixture
def secured_nats(tmp_path):
    server = NatsServer.secured(tmp_path / "nats").start()
    yield server
    server.stop()


async def test_a_node_fetches_a_folder_from_the_schedulers_store(secured_nats, tmp_path):
    head = tmp_path / "head"
    voice = head / "models" / "rhasspy" / "piper-voices" / "en" / "medium"
    whisper = head / "models" / "Systran" / "faster-whisper-tiny"
    (whisper / "sub").mkdir(parents=True)
    voice.mkdir(parents=True)
    files = {
        voice / "v.onnx": os.urandom(1_300_000),
        voice / "v.onnx.json": b'{"audio": {}}',  # 3 chunks
        whisper / "model.bin": os.urandom(70_000),
        whisper / "sub" / "tokenizer.json": b"{}",
    }
    for p, data in files.items():
        p.write_bytes(data)
    sched = Scheduler(SchedulerSettings(nats_url=secured_nats.service_url, data_dir=str(head)))
    async with contextlib.AsyncExitStack() as stack:
        await sched.start(stack, asyncio.Event())
        bus = await Bus.connect(secured_nats.add_node("node-test"), "node-test", inbox_prefix=node_inbox("node-test"))
        stack.push_async_callback(bus.close)
        node = tmp_path / "node" / "models"
        piper = ModelConfig(
            name="p",
            engine="tts",
            path=str(voice / "v.onnx") + ".elsewhere",
            store_path="rhasspy/piper-voices/en/medium/",
            store_file="v.onnx",
        )
        folder = ModelConfig(
            name="w", engine="whisper", path="/nowhere/whisper", store_path="Systran/faster-whisper-tiny/"
        )
        with pytest.raises(FetchError, match="forbidden"):  # a node reads only the files of the models it is given
            await ensure_local(piper, bus_request(bus), node)
        held = [
            piper,
            folder,
            *(
                msgspec.structs.replace(folder, name=f"w{i}", store_path=f"Systran/{p}/")
                for i, p in enumerate(("out", "nothing"))
            ),
        ]
        await sched.kv_assign.put("node-test", encode(Assignment(node_id="node-test", models=held)))
        got = await ensure_local(piper, bus_request(bus), node)
        local = node / "rhasspy" / "piper-voices" / "en" / "medium"
        assert got.path == str(local / "v.onnx")
        assert (local / "v.onnx").read_bytes() == files[voice / "v.onnx"]
        assert (local / "v.onnx.json").read_bytes() == files[voice / "v.onnx.json"]
        got = await ensure_local(folder, bus_request(bus), node)
        assert got.path == str(node / "Systran" / "faster-whisper-tiny")
        assert (node / "Systran" / "faster-whisper-tiny" / "sub" / "tokenizer.json").read_bytes() == b"{}"
        os.symlink(tmp_path, head / "models" / "Systran" / "out")
        with pytest.raises(FetchError, match="leaves the model store"):  # the head's refusal comes back over the bus
            await ensure_local(msgspec.structs.replace(folder, store_path="Systran/out/"), bus_request(bus), node)
        with pytest.raises(FetchError, match="not_found"):
            await ensure_local(msgspec.structs.replace(folder, store_path="Systran/nothing/"), bus_request(bus), node)
