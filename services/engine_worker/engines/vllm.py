"""vLLM through its own OpenAI server, run as a child process: chat (tools, JSON schema) and completions.

The server runs under its own interpreter, because vLLM pins a torch build that rarely matches the worker's: a
worker keeps it in a separate venv. Which one: `params["python"]`, else `find_vllm_python()` (`CODERAI_VLLM_PYTHON`,
else the venv `scripts/setup` links as `vllm/` inside this interpreter's venv), else this interpreter.
The engine translates jobs to OpenAI requests on loopback; vLLM batches concurrent requests itself, so the
engine keeps no lock. A server that dies is restarted (child_server's supervisor, `crash_limit` deaths within
`crash_window_s` park it). Streaming reads the server's SSE and stops on cancel: closing the response drops the
connection, and vLLM aborts a request whose client went away, freeing its KV cache. A whole (non-streamed)
answer is one blocking request, so cancel cannot cut it short.

Model params: `dtype`, `max_model_len`, `gpu_memory_utilization`, `tensor_parallel_size` and any other key
become `--kebab-case value` server flags (`True` a bare flag); `extra_args` is a list appended as is; `env` a
dict added to the server's environment; `python` and `load_timeout_s` (default 600) are the engine's own.
With `params.base` (a fine-tuned model, docs/finetuning.md), `path` is a peft LoRA adapter (the job's tar, or a
folder) and `base` the model folder: the server runs the base with `--enable-lora`, the adapter answering to this
model's name.

A request whose prompt cache is scoped to its key (ChatJob.cache_scope) carries it as vLLM's `cache_salt` (vLLM 0.9
and later): its prefix-cache blocks are then hashed with the salt, so one key never hits another's cached prefix.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from coderai.contracts import ChatJob, CompletionJob
from coderai.engine_worker.engines.base import EngineLoadError, visible_devices
from coderai.engine_worker.engines.hf_chat import unpack_adapter
from coderai.engine_worker.engines.openai_server import OpenAIServerEngine, param_flags
from coderai.engine_worker.engines.server_load import LoadPoll, read_vllm

OWN_PARAMS = frozenset(
    {
        "python",
        "load_timeout_s",
        "extra_args",
        "env",
        "ray_port",
        "ray_join_timeout_s",
        "crash_limit",
        "crash_window_s",
        "base",
    }
)
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM takes


def find_vllm_python() -> str | None:
    """The interpreter of a venv of vLLM's own: `CODERAI_VLLM_PYTHON`, else `<this venv>/vllm/bin/python` (where
    `scripts/setup` links the one it makes), else None. A worker offers the vllm family when there is one."""
    named = os.environ.get("CODERAI_VLLM_PYTHON")
    if named:
        return named
    beside = Path(sys.prefix) / "vllm" / "bin" / "python"
    return str(beside) if beside.exists() else None


def server_command(python: str, model_path: str, name: str, port: int, params: dict[str, Any]) -> list[str]:
    """The argv that starts vLLM's OpenAI server for one model on loopback."""
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        name,
        # usage then says how many prompt tokens came from the prefix cache: the heartbeat's cache counters
        "--enable-prompt-tokens-details",
    ]
    return cmd + param_flags(params, OWN_PARAMS)


def lora_flags(name: str, adapter: Path) -> list[str]:
    """vLLM's flags serving the peft adapter folder `adapter` as model `name` (a request naming `name` runs the
    base with it), at the smallest rank vLLM takes that holds the adapter's."""
    try:
        rank = int(json.loads((adapter / "adapter_config.json").read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineLoadError(f"{adapter} is not a peft LoRA adapter (its adapter_config.json: {exc})") from None
    fits = [r for r in LORA_RANKS if r >= rank]
    if not fits:
        raise EngineLoadError(f"the adapter's rank {rank} is over vLLM's largest, {LORA_RANKS[-1]}")
    module = json.dumps({"name": name, "path": str(adapter)})
    return ["--enable-lora", "--max-lora-rank", str(fits[0]), "--lora-modules", module]


class VllmEngine(OpenAIServerEngine):
    """One model served by a vLLM OpenAI server that this engine starts, owns and stops."""

    family = "vllm"
    label = "vLLM"
    key_env = "VLLM_API_KEY"  # vLLM guards its /v1 routes with it; /health stays open
    max_concurrency = 64  # jobs a worker may run on this engine at once, from as many threads: vLLM batches them
    load_poll: LoadPoll | None = None  # its requests running and waiting and its KV share, for the heartbeat

    def load(self) -> None:
        super().load()
        # the supervisor restarts a server that dies (the engine is reported failed meanwhile, a request it was
        # answering goes to another copy); it starts every later server, which then dies with it
        self.supervise()
        self.load_poll = LoadPoll(self.child, read_vllm)

    def stats(self) -> dict[str, Any]:
        poll = self.load_poll
        return {**super().stats(), **poll.load.stats()} if poll is not None else super().stats()

    def close(self) -> None:
        if self.load_poll is not None:
            self.load_poll.stop()
        super().close()

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        params = dict(self.config.params)
        python = self.config.param_str("python") or find_vllm_python() or sys.executable
        base, name = self.config.param_str("base"), self.config.name
        if base:  # a fine-tuned model: the base served with the adapter, which answers to this model's name
            cmd = server_command(python, os.path.expanduser(base), f"{name}#base", port, params)
            cmd += lora_flags(name, unpack_adapter(Path(os.path.expanduser(self.config.path))))
        else:
            cmd = server_command(python, os.path.expanduser(self.config.path), name, port, params)
        return cmd, {
            **os.environ,
            **visible_devices(self.config),
            **{k: str(v) for k, v in self.config.param_table("env").items()},
        }

    def chat_body(self, job: ChatJob, stream: bool) -> dict[str, Any]:
        body = super().chat_body(job, stream)
        return {**body, "cache_salt": job.cache_scope} if job.cache_scope else body

    def completion_body(self, job: CompletionJob, stream: bool) -> dict[str, Any]:
        body = super().completion_body(job, stream)
        return {**body, "cache_salt": job.cache_scope} if job.cache_scope else body
