"""A peft LoRA adapter (what a fine-tuning job makes) as a GGUF LoRA that `llama-server --lora` applies.

The conversion is llama.cpp's own `convert_lora_to_gguf.py`, from the source `scripts/setup` builds llama-server
from (linked as `<venv>/llama.cpp-convert`; `CODERAI_LLAMA_CONVERT` names another folder), run under this
interpreter (it needs torch, safetensors and numpy: the `finetune` extra). It reads the base model's Hugging Face
`config.json` for the architecture and the Q/K layout: the trainer keeps a copy in the adapter as
`base_config.json`, so the node that serves the adapter needs no Hugging Face folder of the base; a model's
`hf_path` param is read otherwise. The GGUF is written once: beside the folder an adapter tar was unpacked into
(never inside it, where the tar could have put a GGUF of its own), or into an adapter folder given as such.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from coderai.engine_worker.engines.base import EngineLoadError

GGUF_NAME = "adapter.gguf"
BASE_CONFIG = "base_config.json"  # the base model's config.json, as the trainer saved it beside the adapter
CONVERT_TIMEOUT_S = 600


def find_converter() -> Path | None:
    """The folder holding llama.cpp's `convert_lora_to_gguf.py`: `CODERAI_LLAMA_CONVERT`, else the one setup links
    into this interpreter's venv."""
    named = os.environ.get("CODERAI_LLAMA_CONVERT")
    folder = Path(named) if named else Path(sys.prefix) / "llama.cpp-convert"
    return folder if (folder / "convert_lora_to_gguf.py").is_file() else None


def gguf_lora(adapter: Path, hf_base: str = "", out: Path | None = None) -> Path:
    """The GGUF of the peft adapter folder `adapter`, converted once into `out` (default: `adapter.gguf` in the
    folder), written whole, then renamed into place. `hf_base`: a Hugging Face folder of the base, read when the
    adapter has no `base_config.json`. An adapter unpacked from a tar (a node's upload) gets an `out` outside its
    folder: a GGUF the tar brought along is never what llama-server loads."""
    out = out or adapter / GGUF_NAME
    if out.is_file():
        return out
    if not (adapter / "adapter_config.json").is_file():
        raise EngineLoadError(f"{adapter} is not a peft LoRA adapter (no adapter_config.json)")
    if not (adapter / "adapter_model.safetensors").is_file():
        # the converter would torch.load an adapter_model.bin instead: a pickle, which an adapter a node uploaded
        # must never be read as (the trainer always writes safetensors)
        raise EngineLoadError(f"the adapter {adapter.name} has no adapter_model.safetensors (a .bin is not read)")
    config = adapter / BASE_CONFIG
    if not config.is_file():
        config = Path(os.path.expanduser(hf_base)) / "config.json" if hf_base else config
        if not config.is_file():
            raise EngineLoadError(
                f"the adapter {adapter.name} has no {BASE_CONFIG} and the model names no hf_path holding the base "
                "model's config.json: llama.cpp's converter needs the base's architecture"
            )
    converter = find_converter()
    if converter is None:
        raise EngineLoadError(
            "llama.cpp's LoRA converter (convert_lora_to_gguf.py) is not installed: run scripts/setup with the "
            "llama extra, or set CODERAI_LLAMA_CONVERT to a llama.cpp source folder"
        )
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=out.parent) as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        (base / "config.json").write_bytes(config.read_bytes())
        part = Path(tmp) / GGUF_NAME
        cmd = [
            sys.executable,
            str(converter / "convert_lora_to_gguf.py"),
            "--base",
            str(base),
            "--outfile",
            str(part),
            "--outtype",
            "f16",
            str(adapter),
        ]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            raise EngineLoadError(f"converting the adapter to GGUF took over {CONVERT_TIMEOUT_S} s") from None
        if done.returncode != 0 or not part.is_file():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise EngineLoadError(f"llama.cpp could not convert the adapter to GGUF: {tail}")
        os.replace(part, out)
    return out
