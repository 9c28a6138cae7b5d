"""The RPC side of a split model: the gate admits only named peers (and drops one the moment it is no longer named),
binding to every interface needs a flag, llama.cpp's rpc-server runs only while a split is placed, and the split
engine (llama-server --rpc) answers like the whole model, is lost the moment its RPC server dies and serves again
when it is back."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import msgspec
import pytest

from coderai.contracts import ChatJob, ModelConfig, SamplingParams
from coderai.contracts.split import SplitDevice, SplitPlan
from coderai.engine_worker.engines.base import CancelFlag
from coderai.engine_worker.engines.llama_split import link_warning, on_server, split_params
from coderai.engine_worker.rpc import RpcConfigError, RpcGate, cluster_address, gate_address
from coderai.runtime.gguf_meta import block_count
from coderai.testing.procs import wait_until


def plan(mode: str = "layer", layers: bool = True) -> SplitPlan:
    return SplitPlan(
        mode=mode,
        n_layers=4,
        devices=[
            SplitDevice(node_id="a", share=0.5, layers=[0, 1] if layers else []),
            SplitDevice(node_id="b", endpoint="10.0.0.2:50052", share=0.25, layers=[2] if layers else []),
            SplitDevice(node_id="c", endpoint="10.0.0.3:50052", share=0.25, layers=[3] if layers else []),
        ],
    )


def test_split_params_offload_the_remote_layers_shared_by_tensor_split():
    assert split_params(plan(), 4, row=False) == {"n_gpu_layers": 2, "split_mode": "layer", "tensor_split": "0.5,0.5"}
    assert split_params(plan(layers=False), 8, row=False)["n_gpu_layers"] == 4  # by shares when no layer map
    assert split_params(plan("row"), 4, row=True)["split_mode"] == "row"


def test_a_split_model_of_the_in_process_family_runs_on_llama_server_with_the_params_both_take():
    cfg = ModelConfig(name="m", engine="llama", path="/x.gguf", params={"n_ctx": 512, "use_mmap": True})
    served = on_server(cfg)
    assert served.engine == "llama-server" and served.params == {"n_ctx": 512}


def test_the_gate_is_never_bound_to_every_interface_without_the_flag():
    with pytest.raises(RpcConfigError, match="no authentication"):
        gate_address("0.0.0.0", "nats://127.0.0.1:4222", allow_any=False)
    assert gate_address("0.0.0.0", "nats://127.0.0.1:4222", allow_any=True) == "0.0.0.0"
    assert gate_address("", "nats://user:pw@127.0.0.1:4222", allow_any=False) == "127.0.0.1"
    assert cluster_address("nats://127.0.0.1:4222") == "127.0.0.1"


async def test_the_gate_relays_named_peers_only_and_probes_cost_the_server_nothing():
    upstream: list[int] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream.append(1)
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    gate = RpcGate("127.0.0.1", 0, server.sockets[0].getsockname()[1])
    await gate.start()
    gate.allow(["127.0.0.2"])
    loop = asyncio.get_running_loop()

    def connect(source: str) -> socket.socket:
        s = socket.socket()
        s.bind((source, 0))
        s.connect(("127.0.0.1", gate.port))
        s.settimeout(10)
        return s

    try:
        s = await loop.run_in_executor(None, connect, "127.0.0.2")
        await loop.run_in_executor(None, s.sendall, b"hello")
        assert await loop.run_in_executor(None, s.recv, 5) == b"hello"
        s.close()
        probe = await loop.run_in_executor(None, connect, "127.0.0.2")
        probe.close()
        stranger = await loop.run_in_executor(None, connect, "127.0.0.1")
        await loop.run_in_executor(None, stranger.sendall, b"let me in")

        def answer() -> bytes:
            try:
                return stranger.recv(16)
            except ConnectionResetError:
                return b""

        assert await loop.run_in_executor(None, answer) == b""  # closed, nothing relayed
        stranger.close()
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: wait_until(lambda: gate.refused == 1, 5, "refusal")
        )
        assert len(upstream) == 1  # the echo saw the allowed peer only; the probe never reached it
    finally:
        await gate.close()
        server.close()


def test_block_count_reads_the_gguf_header(tiny_gguf, tmp_path):
    assert block_count(tiny_gguf) == 2
    (tmp_path / "x.gguf").write_bytes(b"not a gguf")
    assert block_count(tmp_path / "x.gguf") == 0


# --- a real RPC server on loopback ------------------------------------------------------------------


@pytest.mark.slow
def test_the_split_engine_answers_like_the_whole_model_is_lost_when_its_rpc_server_dies_and_comes_back(tmp_path):
    from coderai.engine_worker.engines.llama_server import LlamaServerEngine
    from coderai.engine_worker.engines.llama_split import SplitServerEngine
    from coderai.engine_worker.rpc import RpcService, find_rpc_server
    from coderai.tiny_models.llm import build_tiny_gguf

    if find_rpc_server() is None:
        pytest.skip("no rpc-server here: scripts/setup builds it")
    path = tmp_path / "four.gguf"
    build_tiny_gguf(path, dim=128, layers=4, heads=4)
    params = {"n_ctx": 512, "n_threads": 1, "parallel": 2, "head_snapshots_mb": 0}
    base = ModelConfig(name="m", engine="llama-server", path=str(path), params=params)
    job = ChatJob(
        request_id="r",
        model="m",
        messages=[{"role": "user", "content": "once upon a time"}],
        params=SamplingParams(max_tokens=12, temperature=0.0),
    )
    whole = LlamaServerEngine(base)
    whole.load()
    expected = whole.chat(job, CancelFlag(), None)[0][0].message
    whole.close()

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    async def start(port: int) -> RpcService:
        svc = RpcService("127.0.0.1", port, threads=1)
        await svc.start()
        return svc

    svc = on_loop(start(0))
    assert svc.proc is None  # no split placed here yet: no RPC server runs
    on_loop(svc.admit(["127.0.0.1"]))
    assert svc.proc is not None and svc.proc.poll() is None
    plan = SplitPlan(
        n_layers=4,
        devices=[
            SplitDevice(node_id="here", share=0.5, layers=[0, 1]),
            SplitDevice(node_id="there", endpoint=f"127.0.0.1:{svc.gate.port}", share=0.5, layers=[2, 3]),
        ],
    )
    engine = SplitServerEngine(msgspec.structs.replace(base, shards=plan))
    lost = threading.Event()
    reasons: list[str] = []
    engine.on_lost = lambda why: (reasons.append(why), lost.set())
    back = threading.Event()
    engine.on_back = back.set
    try:
        engine.load()
        assert "--rpc" in engine.child.proc.args and engine.gpu_layers in (0, 2)
        assert engine.chat(job, CancelFlag(), None)[0][0].message == expected
        streamed: list[dict] = []
        stream_job = ChatJob(request_id="s", model="m", messages=job.messages, params=job.params, stream=True)
        engine.chat(stream_job, CancelFlag(), lambda d, t, f: streamed.append(d or {}))
        assert "".join(d.get("content", "") for d in streamed) == expected["content"]
        port = svc.gate.port
        on_loop(svc.close())
        assert lost.wait(15), "the engine did not notice its RPC server was gone"
        assert "unreachable" in reasons[0] and "there" in reasons[0]
        with pytest.raises(Exception, match="unreachable|exited"):
            engine.chat(job, CancelFlag(), None)

        svc = on_loop(start(port))  # the node restarted quickly: same gate, a fresh server behind it
        on_loop(svc.admit(["127.0.0.1"]))
        assert back.wait(60), "the engine did not load again once its RPC server answered"
        assert engine.chat(job, CancelFlag(), None)[0][0].message == expected

        back.clear()  # the RPC server itself dies while the split is placed: the next heartbeat starts it again
        svc.proc.kill()
        svc.proc.wait()
        on_loop(svc.tend())
        assert svc.proc.poll() is None
        with contextlib.suppress(Exception):  # the split's server finds its RPC connection gone, and restarts
            engine.chat(job, CancelFlag(), None)
        assert back.wait(60), "the engine did not serve again once the RPC server was started again"
        assert engine.chat(job, CancelFlag(), None)[0][0].message == expected
        on_loop(svc.admit([]))  # the split is re-placed elsewhere: the server stops, the gate lets nobody in
        assert svc.proc is None and svc.gate.allowed == frozenset()
    finally:
        engine.close()
        on_loop(svc.close())
        loop.call_soon_threadsafe(loop.stop)


async def test_a_peer_no_longer_named_loses_its_open_relay_at_once():
    held = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.set()
        await reader.read()  # until the gate closes its side
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    gate = RpcGate("127.0.0.1", 0, server.sockets[0].getsockname()[1])
    await gate.start()
    gate.allow(["127.0.0.1"])
    loop = asyncio.get_running_loop()
    try:
        s = socket.create_connection(("127.0.0.1", gate.port), timeout=10)
        s.sendall(b"\x01")  # a first byte: relayed
        await asyncio.wait_for(held.wait(), 10)
        gate.allow([])  # the scheduler stopped naming it

        def rest() -> bytes:
            try:
                return s.recv(16)
            except ConnectionResetError:
                return b""

        assert await loop.run_in_executor(None, rest) == b""  # its relay is closed, not left open
        s.close()
    finally:
        await gate.close()
        server.close()


async def test_the_gate_answers_a_link_probe_itself_and_the_row_split_warning_names_slow_links():
    from coderai.engine_worker.rpc import link_gbps

    upstream: list[int] = []

    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream.append(1)
        writer.close()

    server = await asyncio.start_server(never, "127.0.0.1", 0)
    gate = RpcGate("127.0.0.1", 0, server.sockets[0].getsockname()[1])
    await gate.start()
    gate.allow(["127.0.0.1"])
    loop = asyncio.get_running_loop()
    try:
        gbps = await loop.run_in_executor(None, link_gbps, f"127.0.0.1:{gate.port}", 1 << 20)
        assert gbps > 0 and upstream == []  # measured by the gate, nothing reached the RPC server
        gate.allow([])  # a stranger's probe is refused like any connection
        assert await loop.run_in_executor(None, link_gbps, f"127.0.0.1:{gate.port}", 1 << 20) == 0.0
    finally:
        await gate.close()
        server.close()
    speeds = {"10.0.0.2:50052": 0.94, "10.0.0.3:50052": 25.0}
    warning = link_warning("m", plan("row"), lambda ep: speeds[ep])
    assert "b 0.94 Gb/s" in warning and "c " not in warning
    assert link_warning("m", plan("layer"), lambda ep: 0.5) == ""  # a layer split moves little: no warning
