"""vLLM over several nodes on Ray: the serving node heads a Ray cluster, the plan's other nodes join it, and
vLLM's OpenAI server runs its tensor x pipeline parallel ranks over it (`--distributed-executor-backend ray`).

The scheduler plans it (`SplitPlan(mode="ray")`, devices = nodes with their ranks; the first device serves) and
puts the model in every planned node's assignment. The worker then runs:
- on the serving node, `VllmRayEngine`: `ray start --head` on its cluster address, waits until every planned
  node has joined, then the usual vLLM engine with the Ray backend and the ranks of the plan;
- on the others, `RayMember`: `ray start --address <head>` kept running; it answers no requests.
Ray and vLLM run under vLLM's interpreter (as `VllmEngine`'s: `params["python"]`, else `find_vllm_python()`).
Ray's ports: GCS `params["ray_port"]` (default 6385: 6379, Ray's own default, is Redis's), the rest Ray picks.

The commands and environment are pure functions (unit-tested); every process runs in its own session so
closing the engine stops Ray's raylet, GCS and workers too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgspec

from coderai.contracts import ModelConfig
from coderai.contracts.split import SplitPlan
from coderai.engine_worker.engines.base import Engine, EngineLoadError
from coderai.engine_worker.engines.processes import start_process, stop_process
from coderai.engine_worker.engines.vllm import VllmEngine, find_vllm_python

DEFAULT_RAY_PORT = 6385
JOIN_TIMEOUT_S = 300.0
RAY_PARAMS = frozenset({"ray_port", "ray_join_timeout_s"})


def python_for(config: ModelConfig) -> str:
    return config.param_str("python") or find_vllm_python() or sys.executable


def ray_port(config: ModelConfig) -> int:
    return config.param_int("ray_port") or DEFAULT_RAY_PORT


def ray_env(addr: str, interface: str = "") -> dict[str, str]:
    """Environment for Ray and vLLM on a node whose cluster address is `addr` (and interface, when known):
    every process binds and advertises that address, and the collective libraries use that interface."""
    env = {"VLLM_HOST_IP": addr, "RAY_DISABLE_USAGE_STATS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    if interface:
        env |= {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface, "TP_SOCKET_IFNAME": interface}
    return env


def ray_head_command(python: str, addr: str, port: int, ranks: int, gpus: int) -> list[str]:
    return [
        python,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--block",
        "--node-ip-address",
        addr,
        "--port",
        str(port),
        "--num-cpus",
        str(max(1, ranks)),
        "--num-gpus",
        str(gpus),
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]


def ray_member_command(python: str, head: str, port: int, addr: str, ranks: int, gpus: int) -> list[str]:
    return [
        python,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--block",
        "--address",
        f"{head}:{port}",
        "--node-ip-address",
        addr,
        "--num-cpus",
        str(max(1, ranks)),
        "--num-gpus",
        str(gpus),
        "--disable-usage-stats",
    ]


def vllm_ray_params(config: ModelConfig, plan: SplitPlan) -> dict[str, object]:
    """The model's vLLM params with the Ray backend; Ray's own params taken out (they are not vLLM flags)."""
    params = {k: v for k, v in config.params.items() if k not in RAY_PARAMS}
    world = sum(d.ranks for d in plan.devices)
    tp = config.param_int("tensor_parallel_size") or 1
    pp = config.param_int("pipeline_parallel_size") or 1
    if tp * pp != world:
        raise EngineLoadError(f"the plan has {world} ranks but the model asks for tensor {tp} x pipeline {pp}")
    return params | {"distributed_executor_backend": "ray"}


def interface_of(addr: str) -> str:
    """The network interface holding `addr` ("" if none does)."""
    import ifaddr

    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if (ip.ip if isinstance(ip.ip, str) else ip.ip[0]) == addr:
                return adapter.nice_name
    return ""


def alive_nodes_script(address: str) -> list[str]:
    """A one-liner (run under vLLM's interpreter) printing how many Ray nodes are alive at `address`."""
    return [
        "-c",
        f"import ray; ray.init(address={address!r}, logging_level='ERROR'); "
        "print(sum(1 for n in ray.nodes() if n['Alive']))",
    ]


class VllmRayEngine(VllmEngine):
    """The serving node of a Ray plan: Ray head, then vLLM over every planned node's ranks."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.shards is not None and config.shards.mode == "ray"
        self.plan = config.shards
        self.ray: subprocess.Popen | None = None

    def load(self) -> None:
        me = self.plan.devices[0]
        python, port = python_for(self.config), ray_port(self.config)
        env = ray_env(me.endpoint, interface_of(me.endpoint))
        self.ray, log_path = start_process(ray_head_command(python, me.endpoint, port, me.ranks, 0), env, "ray-head")
        address = f"{me.endpoint}:{port}"
        deadline = time.monotonic() + (self.config.param_float("ray_join_timeout_s") or JOIN_TIMEOUT_S)
        want = len(self.plan.devices)
        while True:  # every planned node must have joined before vLLM places its ranks
            r = subprocess.run(
                [python, *alive_nodes_script(address)],
                capture_output=True,
                text=True,
                env={**os.environ, **env},
                timeout=120,
            )
            alive = int(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else 0
            if alive >= want:
                break
            if self.ray.poll() is not None or time.monotonic() > deadline:
                stop_process(self.ray)
                raise EngineLoadError(f"Ray at {address} has {alive} of {want} nodes (log: {log_path})")
        params = vllm_ray_params(self.config, self.plan)
        params["env"] = {**self.config.param_table("env"), **env, "RAY_ADDRESS": address}
        self.config = msgspec.structs.replace(self.config, params=params)
        try:
            super().load()
        except EngineLoadError:
            stop_process(self.ray)
            raise

    def close(self) -> None:
        super().close()
        stop_process(self.ray)
        self.ray = None


class RayMember(Engine):
    """A non-serving node of a Ray plan: keeps `ray start --address <head>` running; serves no requests."""

    family = "vllm"
    member = True  # the worker subscribes nothing and advertises no ops for it

    def __init__(self, config: ModelConfig, node_id: str) -> None:
        super().__init__(config)
        assert config.shards is not None
        self.plan = config.shards
        self.node_id = node_id
        self.proc: subprocess.Popen | None = None

    def load(self) -> None:
        head = self.plan.devices[0]
        me = next((d for d in self.plan.devices if d.node_id == self.node_id), None)
        if me is None:
            raise EngineLoadError(f"node {self.node_id} is not in the Ray plan of {self.config.name}")
        python, port = python_for(self.config), ray_port(self.config)
        env = ray_env(me.endpoint, interface_of(me.endpoint))
        # the serving node waits until this node has joined; a member that cannot join fails its load there
        self.proc, _ = start_process(
            ray_member_command(python, head.endpoint, port, me.endpoint, me.ranks, 0), env, "ray-member"
        )

    def close(self) -> None:
        stop_process(self.proc)
        self.proc = None


__all__ = ["RayMember", "VllmRayEngine", "ray_env", "ray_head_command", "ray_member_command", "vllm_ray_params"]
