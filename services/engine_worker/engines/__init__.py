"""Engine families a worker can run. Each is imported only when a model of its family is assigned."""

from __future__ import annotations

import importlib.util
import os

from coderai.engine_worker.engines.base import BadInput, Engine, EngineLoadError

# family -> (module that must be importable, module:class that runs it)
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("llama_cpp", "coderai.engine_worker.engines.llama:LlamaEngine"),
    "llama-server": ("", "coderai.engine_worker.engines.llama_server:LlamaServerEngine"),  # a binary, not a module
    "vllm": ("vllm", "coderai.engine_worker.engines.vllm:VllmEngine"),
    "embed": ("sentence_transformers", "coderai.engine_worker.engines.embed:EmbedEngine"),
    "diffusers": ("diffusers", "coderai.engine_worker.engines.diffusion:ImageEngine"),
    "video": ("diffusers", "coderai.engine_worker.engines.diffusion:VideoEngine"),
    "whisper": ("faster_whisper", "coderai.engine_worker.engines.whisper:WhisperEngine"),
    "tts": ("piper", "coderai.engine_worker.engines.tts:PiperEngine"),
    "diarize": ("resemblyzer", "coderai.engine_worker.engines.diarize:DiarizeEngine"),
    "ocr": ("rapidocr", "coderai.engine_worker.engines.ocr:OcrEngine"),
    "transformers": ("transformers", "coderai.engine_worker.engines.hf_chat:TransformersEngine"),
    "echo": ("coderai.testing", "coderai.testing.echo_engine:EchoEngine"),
}

# Test engines: offered only when a worker's settings name them (CODERAI_WORKER_FAMILIES), never by default.
EXPLICIT_ONLY = frozenset({"echo"})


def available_families() -> list[str]:
    """Engine families whose libraries are installed on this machine (test engines left out)."""
    return [
        fam for fam, (probe, _) in FAMILIES.items()
        if fam not in EXPLICIT_ONLY and ((probe and importlib.util.find_spec(probe) is not None) or _external(fam))
    ]


def _external(family: str) -> bool:
    if family == "llama-server":  # llama.cpp's server binary (scripts/setup builds it), not a Python module
        from coderai.engine_worker.engines.llama_server import find_binary

        return find_binary() is not None
    # vLLM pins its own torch, so a worker may keep it in another venv and name that interpreter instead
    return family == "vllm" and bool(os.environ.get("CODERAI_VLLM_PYTHON"))


def engine_class(family: str) -> type[Engine]:
    if family not in FAMILIES:
        raise EngineLoadError(f"no engine family {family!r} in this worker (have {sorted(FAMILIES)})")
    module, _, cls = FAMILIES[family][1].partition(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["BadInput", "Engine", "EngineLoadError", "EXPLICIT_ONLY", "FAMILIES", "available_families", "engine_class"]
