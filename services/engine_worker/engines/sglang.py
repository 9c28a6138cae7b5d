"""SGLang (and ktransformers through it) as a child server: its OpenAI server on loopback, one node or several.

`python -m sglang.launch_server` under SGLang's own interpreter (`params["python"]`, else `CODERAI_SGLANG_PYTHON`,
else the venv linked as `sglang/` beside this one): SGLang pins its own torch and CUDA kernels. SGLang reads its API
key only from `--api-key`, which every local user sees in `ps`; so the server is started through a two-line
launcher (`LAUNCH`) that takes the key from the environment, drops it from there and appends it to SGLang's own
argv in-process: the command line shows everything but the key.

Model params: `tp_size`, `pp_size`, `dp_size`, `mem_fraction_static`, `context_length`, ... and any other key become
`--kebab-case value` flags (`True` a bare flag), checked against SGLang's own parser in the suite; the `kt_*`
params are ktransformers' (its CPU/GPU expert split: `kt_weight_path`, `kt_method`, `kt_cpuinfer`,
`kt_threadpool_count`, `kt_num_gpu_experts`), which SGLang's server takes since ktransformers 0.4.

Over several nodes (a model whose `tp_size x pp_size` ranks exceed one node's cards): the scheduler plans it as
vLLM's (`SplitPlan`, mode `ranks`: the serving node first, each node with its ranks). Every planned node runs the
same server with `--nnodes`, its `--node-rank` and the first node's `--dist-init-addr` (its cluster address and
`dist_port`); the serving node (rank 0) answers HTTP, the others (`SGLangMember`) only run their ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from coderai.contracts import ModelConfig
from coderai.contracts.split import SplitPlan
from coderai.engine_worker.engines.base import Engine, EngineLoadError, visible_devices
from coderai.engine_worker.engines.openai_server import OpenAIServerEngine, param_flags
from coderai.engine_worker.engines.processes import start_process, stop_process
from coderai.runtime.embedded import free_port

KEY_ENV = "CODERAI_SGLANG_API_KEY"
DEFAULT_DIST_PORT = 5757
OWN_PARAMS = frozenset({"python", "load_timeout_s", "extra_args", "env", "dist_port", "crash_limit", "crash_window_s"})
# the launcher: SGLang's argv plus the key from the environment, which then leaves the environment (children of the
# server do not inherit it); `python -c LAUNCH <args>` is what `ps` shows
LAUNCH = (
    "import os, runpy, sys; "
    f"key = os.environ.pop({KEY_ENV!r}, ''); "
    "sys.argv = ['sglang.launch_server', *sys.argv[1:], *(['--api-key', key] if key else [])]; "
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)"
)


def find_sglang_python() -> str | None:
    """The interpreter of a venv of SGLang's own: `CODERAI_SGLANG_PYTHON`, else `<this venv>/sglang/bin/python`."""
    named = os.environ.get("CODERAI_SGLANG_PYTHON")
    if named:
        return named
    beside = Path(sys.prefix) / "sglang" / "bin" / "python"
    return str(beside) if beside.exists() else None


def python_for(config: ModelConfig) -> str:
    return config.param_str("python") or find_sglang_python() or sys.executable


def world_size(m: ModelConfig) -> int:
    """The ranks a model asks SGLang for: tensor x pipeline parallel (data parallel copies are within them)."""
    return max(1, m.param_int("tp_size") or 1) * max(1, m.param_int("pp_size") or 1)


def rank_flags(plan: SplitPlan, node_id: str, dist_port: int) -> list[str]:
    """`--nnodes`, this node's `--node-rank` and the serving node's `--dist-init-addr` for a plan over nodes."""
    ranks = [d.ranks for d in plan.devices]
    if len(set(ranks)) != 1:  # SGLang splits tp_size evenly over its nodes
        raise EngineLoadError(f"SGLang needs the same ranks on every node; the plan has {ranks}")
    index = next((i for i, d in enumerate(plan.devices) if d.node_id == node_id), None)
    if index is None:
        raise EngineLoadError(f"node {node_id} is not in the plan")
    head = plan.devices[0].endpoint
    if not head:
        raise EngineLoadError("the plan's serving node has no cluster address")
    return ["--nnodes", str(len(plan.devices)), "--node-rank", str(index), "--dist-init-addr", f"{head}:{dist_port}"]


def server_args(
    model_path: str, name: str, port: int, params: dict[str, Any], ranks: list[str] | None = None
) -> list[str]:
    """SGLang's own arguments for one model on 127.0.0.1:`port` (what its parser sees)."""
    args = ["--model-path", model_path, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name]
    args += ["--enable-metrics"]  # /metrics: running and queued requests, KV use, for the heartbeat and Prometheus
    return args + (ranks or []) + param_flags(params, OWN_PARAMS)


def server_command(python: str, args: list[str]) -> list[str]:
    return [python, "-c", LAUNCH, *args]


def server_env(config: ModelConfig) -> dict[str, str]:
    return {**os.environ, **visible_devices(config), **{k: str(v) for k, v in config.param_table("env").items()}}


class SGLangEngine(OpenAIServerEngine):
    """One model served by an SGLang OpenAI server this engine starts, owns and stops (on a plan: rank 0)."""

    family = "sglang"
    label = "SGLang"
    key_env = KEY_ENV  # read by LAUNCH, never on the command line
    max_concurrency = 64  # SGLang batches concurrent requests itself

    def __init__(self, config: ModelConfig, node_id: str = "") -> None:
        super().__init__(config)
        self.node_id = node_id

    def load(self) -> None:
        super().load()
        self.supervise()  # restarted when it dies, parked after crash_limit deaths (child_server)

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        cfg = self.config
        plan = cfg.shards
        ranks: list[str] = []
        if plan is not None and plan.mode == "ranks":
            ranks = rank_flags(plan, self.node_id or plan.devices[0].node_id, dist_port(cfg))
        args = server_args(os.path.expanduser(cfg.path), cfg.name, port, dict(cfg.params), ranks)
        return server_command(python_for(cfg), args), server_env(cfg)


def dist_port(config: ModelConfig) -> int:
    return config.param_int("dist_port") or DEFAULT_DIST_PORT


class SGLangMember(Engine):
    """A non-serving node of an SGLang plan: runs its ranks (`--node-rank` > 0); answers no requests."""

    family = "sglang"
    member = True  # the worker subscribes nothing and advertises no ops for it

    def __init__(self, config: ModelConfig, node_id: str) -> None:
        super().__init__(config)
        if config.shards is None or config.shards.mode != "ranks":
            raise EngineLoadError("an SGLang member needs a plan over nodes")
        self.plan = config.shards
        self.node_id = node_id
        self.proc: subprocess.Popen | None = None

    def command(self, port: int) -> list[str]:
        cfg = self.config
        ranks = rank_flags(self.plan, self.node_id, dist_port(cfg))
        return server_command(
            python_for(cfg), server_args(os.path.expanduser(cfg.path), cfg.name, port, dict(cfg.params), ranks)
        )

    def load(self) -> None:
        # the serving node's load waits for every rank; a member that cannot join fails it there. Its own HTTP
        # port (SGLang binds one on every rank) is a free loopback one, never used
        self.proc, _ = start_process(self.command(free_port()), server_env(self.config), "sglang-member")

    def close(self) -> None:
        stop_process(self.proc)
        self.proc = None


__all__ = ["SGLangEngine", "SGLangMember", "rank_flags", "server_args", "server_command", "world_size"]
