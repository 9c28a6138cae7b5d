"""Engine families a worker can run. Each is imported only when a model of its family is assigned."""

from __future__ import annotations

import importlib.util
import logging

import msgspec

from coderai.contracts import ModelConfig
from coderai.contracts.families import FAMILIES as SPECS
from coderai.engine_worker.engines.base import BadInput, Engine, EngineLoadError
from coderai.runtime.embedded import find_llama_server

log = logging.getLogger("coderai.engine_worker")

# family -> (module that must be importable, module:class that runs it): each family's `FamilySpec`
FAMILIES: dict[str, tuple[str, str]] = {name: (spec.needs, spec.runner) for name, spec in SPECS.items()}

# Test engines: offered only when a worker's settings name them (CODERAI_WORKER_FAMILIES), never by default.
EXPLICIT_ONLY = frozenset(name for name, spec in SPECS.items() if spec.test_only)


def available_families() -> list[str]:
    """Engine families whose libraries are installed on this machine (test engines left out)."""
    return [
        fam
        for fam, (probe, _) in FAMILIES.items()
        if fam not in EXPLICIT_ONLY and ((probe and importlib.util.find_spec(probe) is not None) or _external(fam))
    ]


def _external(family: str) -> bool:
    if family == "llama-server":  # llama.cpp's server binary (scripts/setup builds it), else the in-process engine
        return find_llama_server() is not None or importlib.util.find_spec("llama_cpp") is not None
    if family == "sglang":  # likewise in a venv of its own (CODERAI_SGLANG_PYTHON, or .venv/sglang)
        from coderai.engine_worker.engines.sglang import find_sglang_python

        return find_sglang_python() is not None
    if family != "vllm":
        return False
    # vLLM pins its own torch, so a worker keeps it in a venv of its own: CODERAI_VLLM_PYTHON, or the one scripts/setup
    # links as .venv/vllm (imported here only when asked: the engine modules load when a model of theirs is placed)
    from coderai.engine_worker.engines.vllm import find_vllm_python

    return find_vllm_python() is not None


# what only the llama-server family reads; dropped when a model falls back to the in-process engine
SERVER_ONLY_PARAMS = frozenset(
    {
        "parallel",
        "cache_ram_mb",
        "queue",
        "load_timeout_s",
        "extra_args",
        "env",
        "mmproj",
        "chat_template",
        "n_gpu_layers_draft",
    }
)


def resolve(cfg: ModelConfig) -> ModelConfig:
    """The config a worker loads: a `llama-server` model on a machine without the binary (a plain `pip install`)
    runs on the in-process llama engine instead, one request at a time, with a warning saying so."""
    if cfg.engine != "llama-server" or find_llama_server() is not None or importlib.util.find_spec("llama_cpp") is None:
        return cfg
    log.warning(
        "%s: no llama-server binary here (scripts/setup builds it; or set CODERAI_LLAMA_SERVER): serving it "
        "on the in-process llama engine, one request at a time",
        cfg.name,
    )
    return msgspec.structs.replace(
        cfg, engine="llama", params={k: v for k, v in cfg.params.items() if k not in SERVER_ONLY_PARAMS}
    )


def engine_class(family: str) -> type[Engine]:
    if family not in FAMILIES:
        raise EngineLoadError(f"no engine family {family!r} in this worker (have {sorted(FAMILIES)})")
    module, _, cls = FAMILIES[family][1].partition(":")
    return getattr(importlib.import_module(module), cls)


__all__ = [
    "BadInput",
    "Engine",
    "EngineLoadError",
    "EXPLICIT_ONLY",
    "FAMILIES",
    "available_families",
    "engine_class",
    "resolve",
]
