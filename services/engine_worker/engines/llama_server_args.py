"""The command line of llama.cpp's server (`llama-server`) for one model, and what its log and metrics say back.
Pure functions of the model's config (the engine is llama_server).

Model params (named): `parallel` (slots, default 4), `n_ctx` (context per slot, default 2048: the server gets
n_ctx x parallel), `n_gpu_layers` (default: all, where the build has a GPU backend), `mmproj` (a projector GGUF for
image input), `cache_ram_mb` (the server's host prompt cache, default 1/32 of the node's RAM; always 0 for a
model with `share_cache = false`, whose tenants must not share it: see slot_scope), `n_threads`, `n_threads_batch`,
`n_batch`, `n_ubatch`, `chat_template`, `queue` (jobs the worker holds beyond the slots at most, default 256),
`head_snapshots_mb` (disk for snapshots of long prompt heads, default 2048; 0 turns them off: see prompt_heads). The
other params the family takes (coderai.engine_params, e.g. `flash_attn`, `cache_type_k`, `model_draft`) become
`--kebab-case value` flags (`True` a bare flag); a param outside that table is refused, never passed on. From the
operator's own models file only: `extra_args` (appended as is) and `env` (added to the server's environment). A copy the scheduler pinned to GPUs (`devices`) sees only those (CUDA_VISIBLE_DEVICES).
The binary: `CODERAI_LLAMA_SERVER`, else `llama-server` beside this interpreter (what
`scripts/setup` builds into `.venv/bin`), else on `PATH`.
"""

from __future__ import annotations

import os
import re
import subprocess

from coderai.contracts import ModelConfig
from coderai.engine_worker.engines.base import visible_devices
from coderai.engine_worker.engines.openai_server import param_flags
from coderai.engine_worker.engines.server_load import llama_load
from coderai.runtime.embedded import find_llama_server
from coderai.runtime.gguf_meta import block_count

NAMED = {
    "n_threads": "--threads",
    "n_threads_batch": "--threads-batch",
    "n_batch": "--batch-size",
    "n_ubatch": "--ubatch-size",
    "chat_template": "--chat-template",
    "mmproj": "--mmproj",
}
OWN_PARAMS = (
    frozenset(
        {
            "parallel",
            "n_ctx",
            "n_gpu_layers",
            "cache_ram_mb",
            "queue",
            "load_timeout_s",
            "extra_args",
            "env",
            "prompt_cache_mb",
            "head_snapshots_mb",
            "crash_limit",
            "crash_window_s",
            "base",  # a fine-tuned model's base GGUF (its path is the LoRA adapter)
            "hf_path",  # the Hugging Face folder the GGUF was made from: what fine-tuning trains on
        }
    )
    | NAMED.keys()
)
DEFAULT_PARALLEL = 4
DEFAULT_N_CTX = 2048
DEFAULT_HEAD_SNAPSHOTS_MB = 2048
# The server's host prompt cache, per server, unless a model's `cache_ram_mb` says: 1/32 of the node's RAM, at
# least 64 MiB, at most 1 GiB. Measured (docs/benchmarks.md, bench/prompt_cache.py): over 8,000 distinct prompts
# every cached prompt is looked at for each new one, so a request slowed from 11 to 32 ms at 256 MiB and to 41 ms
# at 1 GiB on the tiny model (many small entries), while llama.cpp's 8 GiB default only bounds memory it may take.
CACHE_RAM_SHARE = 32
CACHE_RAM_MIN_MB, CACHE_RAM_MAX_MB = 64, 1024


def default_cache_ram_mb(mem_total: int | None = None) -> int:
    """The host prompt cache a server gets from the node's RAM (bytes; this machine's when None)."""
    if mem_total is None:
        from coderai.engine_worker.node import memory

        mem_total = memory()[0]
    if mem_total <= 0:
        return CACHE_RAM_MIN_MB
    return max(CACHE_RAM_MIN_MB, min(CACHE_RAM_MAX_MB, (mem_total >> 20) // CACHE_RAM_SHARE))


def find_binary() -> str | None:
    """The llama-server to run (coderai.runtime.embedded.find_llama_server)."""
    return find_llama_server()


_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_DEVICE = re.compile(r"using device (\w+?)\d* \(|ggml_(cuda|vulkan|metal|sycl|hip)_init: found [1-9]", re.IGNORECASE)


def offload_of(log: str) -> tuple[str, int]:
    """(backend, layers on the GPU) from a llama-server start log: ("cpu", 0) when nothing went to a GPU."""
    m = _OFFLOADED.search(log)
    layers = int(m.group(1)) if m else 0
    if layers == 0:
        return "cpu", 0
    d = _DEVICE.search(log)
    name = (d.group(1) or d.group(2)) if d else "gpu"
    return name.lower(), layers


_LISTED = re.compile(r"^\s*([A-Za-z]+)\d+: ", re.MULTILINE)
_LISTS: dict[tuple[str, str], str] = {}


def build_backend(binary: str, env: dict[str, str]) -> str:
    """The GPU backend this llama-server build sees with the child's environment ("vulkan", "cuda", ...; "" none):
    the first device `--list-devices` names, asked once per binary and visible-device setting."""
    key = (binary, "|".join(env.get(k, "") for k in ("GGML_VK_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")))
    if key not in _LISTS:
        try:
            out = subprocess.run(
                [binary, "--list-devices"],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
                stdin=subprocess.DEVNULL,
            )
            m = _LISTED.search(out.stdout + out.stderr)
            _LISTS[key] = m.group(1).lower() if m else ""
        except (OSError, subprocess.TimeoutExpired):
            _LISTS[key] = ""
    return _LISTS[key]


def offload(config: ModelConfig, log: str, binary: str, env: dict[str, str]) -> tuple[str, int]:
    """(backend, layers on the GPU) of a started llama-server: from its log where it says (builds that log their
    offload at the default verbosity), else from what it was asked and can do (llama.cpp from 0.5 logs neither
    device nor offload unless verbose, which writes ~35 lines a request): the build's first GPU backend, and
    `n_gpu_layers` of the model's blocks plus its output layer ("all" when not given)."""
    said = offload_of(log)
    if said[1] or (ngl := config.param_int("n_gpu_layers")) == 0:
        return said
    backend = build_backend(binary, env)
    if not backend:
        return said
    total = block_count(os.path.expanduser(config.path)) + 1
    return backend, total if ngl is None or ngl < 0 or ngl >= total else ngl


def server_args(config: ModelConfig, port: int) -> list[str]:
    """The flags that start llama-server for `config` on 127.0.0.1:`port` (the binary not included)."""
    p = dict(config.params)
    parallel = config.param_int("parallel") or DEFAULT_PARALLEL
    n_ctx = config.param_int("n_ctx") or DEFAULT_N_CTX
    ngl = config.param_int("n_gpu_layers")
    args = [
        "--model",
        os.path.expanduser(config.path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--alias",
        config.name,
        "--parallel",
        str(parallel),
        "--ctx-size",
        str(n_ctx * parallel),
        "--jinja",
        "--metrics",
        "--slots",
        "--no-webui",
        "--n-gpu-layers",
        str(999 if ngl is None or ngl < 0 else ngl),
        "--cache-ram",
        str(cache_ram_mb(config)),
    ]
    for key, flag in NAMED.items():
        if p.get(key) not in (None, ""):
            value = p[key]
            args += [flag, os.path.expanduser(str(value)) if key == "mmproj" else str(value)]
    if "embed" in config.serves() and not p.get("embedding"):
        args.append("--embedding")  # an embedding model (ops = ["embed"]): /v1/embeddings, pooled per input
    if "embed" in config.serves() and not p.get("pooling"):
        args += ["--pooling", gguf_pooling(os.path.expanduser(config.path))]
    return args + param_flags(p, OWN_PARAMS)


def cache_ram_mb(config: ModelConfig) -> int:
    """The server's host prompt cache: none for a model whose cache tenants do not share (the cache is one pool
    for every slot, so it would hand one key's saved prompt to another), else the model's `cache_ram_mb`, else the
    node's default."""
    if config.share_cache is False:
        return 0
    mb = config.param_int("cache_ram_mb")
    return default_cache_ram_mb() if mb is None else mb


def server_env(config: ModelConfig, base: dict[str, str]) -> dict[str, str]:
    """The child's environment: `base` (the worker's), pinned to the copy's GPUs when the scheduler gave it some
    (the server's main GPU is then the first, and it splits a model over the rest by itself), then the model's
    own `env`, which an operator may use to pin it otherwise."""
    return {**base, **visible_devices(config), **{k: str(v) for k, v in config.param_table("env").items()}}


POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's enum; 0 (none) and 4 (rank) give no vector a text


def gguf_pooling(path: str) -> str:
    """The pooling a GGUF names for itself (BERT-style embedding models often say cls), else mean."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
        field = reader.fields.get(f"{arch}.pooling_type")
        return POOLING_TYPES.get(int(field.parts[-1][0]), "mean") if field is not None else "mean"
    except Exception:  # unreadable here: llama.cpp itself will say what is wrong with the file
        return "mean"


def slot_load(metrics_text: str) -> tuple[int, int]:
    """(requests running in a slot, requests waiting for one) from the server's Prometheus text."""
    load = llama_load(metrics_text)
    return load.running, load.waiting
