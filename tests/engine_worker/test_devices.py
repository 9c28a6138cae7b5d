"""A copy the scheduler pinned to GPUs (`devices`) starts on them; without devices nothing changes."""

from __future__ import annotations

from coderai.contracts import ModelConfig
from coderai.engine_worker.engines import llama_server
from coderai.engine_worker.engines.base import torch_device, visible_devices
from coderai.engine_worker.engines.llama import gpu_params
from coderai.engine_worker.host import EngineHost
from coderai.engine_worker.node import build_heartbeat
from coderai.engine_worker.settings import WorkerSettings
from coderai.runtime.settings import load_settings
from coderai.sizing import estimate_bytes


def cfg(engine: str = "llama-server", devices: list[int] | None = None, **params) -> ModelConfig:
    return ModelConfig(name="m", engine=engine, path="/models/m.gguf", params=params, devices=devices or [])


def test_the_llama_server_child_sees_only_its_assigned_gpus(monkeypatch):
    monkeypatch.setattr(llama_server, "find_binary", lambda: "/opt/llama-server")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # the worker's own view of the machine
    eng = llama_server.LlamaServerEngine(cfg(devices=[1, 3]))
    argv, env = eng.command(4321)
    eng.heads.close()
    args = llama_server.server_args(cfg(devices=[1, 3]), 4321)
    assert argv[0] == "/opt/llama-server" and argv[1:] == [*args, "--slot-save-path", eng.heads.dir]
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    eng = llama_server.LlamaServerEngine(cfg(devices=[2]))
    _, env = eng.command(4321)
    eng.heads.close()
    assert env["CUDA_VISIBLE_DEVICES"] == "2"


def test_without_devices_the_child_keeps_the_workers_environment_and_a_models_env_wins():
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert llama_server.server_env(cfg(), base) == base
    pinned = llama_server.server_env(cfg(devices=[1], env={"CUDA_VISIBLE_DEVICES": "0"}), base)
    assert pinned["CUDA_VISIBLE_DEVICES"] == "0"  # the operator's own pin, in the model's env
    assert visible_devices(cfg()) == {}


def test_the_in_process_llama_engine_offloads_to_its_cards_only():
    assert gpu_params([], {}, []) == {}  # a CPU run is unchanged
    assert gpu_params([1], {}, []) == {"n_gpu_layers": -1, "main_gpu": 1, "split_mode": 0}
    two = gpu_params([0, 2], {}, [10, 99, 30])
    assert two["split_mode"] == 1 and two["tensor_split"] == [10.0, 0.0, 30.0] and two["main_gpu"] == 0
    assert "n_gpu_layers" not in gpu_params([0], {"n_gpu_layers": 12}, [])  # the params' own choice stays


def test_in_process_torch_engines_load_on_the_first_assigned_card():
    assert torch_device(cfg("embed", devices=[2]), "cpu") == "cuda:2"
    assert torch_device(cfg("embed"), "cpu") == "cpu"


def test_the_status_reports_the_bytes_placed_for_and_the_cards():
    pinned = cfg(devices=[1])
    status = EngineHost(None, "n1", pinned, 1.0).status()
    assert status.devices == [1] and status.memory == estimate_bytes(pinned) > 0
    assert EngineHost(None, "n1", cfg(), 1.0).status().devices == []


def test_the_memory_budget_setting_becomes_the_heartbeats_mem_budget_in_bytes():
    settings = load_settings(WorkerSettings, "worker", env={"CODERAI_WORKER_MEMORY_BUDGET_MB": "3000"})
    hb = build_heartbeat("n1", 1, ["llama"], [], mem_budget=settings.memory_budget_mb << 20)
    assert hb.mem_budget == 3000 << 20
    assert build_heartbeat("n1", 1, ["llama"], []).mem_budget == 0


def test_stored_files_are_the_fetched_and_verified_ones(tmp_path):
    from coderai.engine_worker.fetch import stored_files

    (tmp_path / "org" / "f").mkdir(parents=True)
    for rel in ("org/m.gguf", "org/f/f.gguf", "org/half.gguf"):
        (tmp_path / rel).write_bytes(b"x")
    for rel in ("org/m.gguf", "org/f/f.gguf"):  # the notes a verified fetch leaves beside the file
        p = tmp_path / rel
        p.with_name(f".{p.name}.sha256").write_text("0" * 64)
    (tmp_path / "org" / ".gone.gguf.sha256").write_text("0" * 64)  # a note whose file was deleted
    assert stored_files(tmp_path) == ["org/f/f.gguf", "org/m.gguf"]
    assert stored_files(tmp_path / "missing") == []
