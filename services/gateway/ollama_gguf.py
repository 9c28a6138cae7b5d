"""What Ollama's `/api/show` and `/api/tags` say about a GGUF model, read from the file: its architecture, parameter
count, quantization, context length, chat template, size and sha256.

The header is read by hand (coderai.runtime.gguf_meta's steps), not with gguf's GGUFReader: GGUFReader decodes
every vocabulary entry into arrays of its own, ~36 s for Gemma 3's 262k tokens on a busy 2-core machine, where
stepping over them takes ~0.3 s. Each file is read once per (path, size, mtime); its sha256 is computed once, in a
thread, or taken from what already names it (an uploaded blob's name, the catalogue's LFS etag)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coderai.runtime.gguf_meta import layout

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
BLOB_NAME = re.compile(r"^sha256-([0-9a-f]{64})$")


@dataclass(frozen=True)
class GgufFacts:
    """One GGUF file as Ollama describes a model."""

    architecture: str
    parameters: int  # the tensors' elements, summed
    file_type: int | None
    size_label: str
    context_length: int | None
    template: str
    info: dict[str, Any] = field(default_factory=dict)  # general.* and <arch>.* scalars, Ollama's `model_info`
    size: int = 0
    mtime: float = 0.0

    @property
    def parameter_size(self) -> str:
        return human_number(self.parameters) if self.parameters else self.size_label

    @property
    def quantization_level(self) -> str:
        return file_type_name(self.file_type)

    @property
    def projector(self) -> bool:
        """A vision or audio projector (an mmproj), not a language model."""
        return self.architecture == "clip"


def human_number(n: int) -> str:
    """A parameter count as Ollama writes it: 268098176 is "268.10M", 7615616512 "7.6B", 8000000000 "8B"."""
    for unit, scale, places in (("B", 1e9, 1), ("M", 1e6, 2)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.{places}f}{unit}"
    return f"{n / 1e3:.0f}K" if n >= 1000 else str(n)


def file_type_name(file_type: int | None) -> str:
    """`general.file_type` by llama.cpp's name without its prefix: 15 is Q4_K_M, 1 is F16; "" when unknown."""
    if file_type is None:
        return ""
    try:
        from gguf import LlamaFileType

        name = LlamaFileType(file_type).name
    except (ImportError, ValueError):
        return ""
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def read_facts(path: str | os.PathLike[str]) -> GgufFacts:
    """The header of `path`, key/values and tensor shapes, never the tensor data; ValueError if it is no GGUF."""
    st = os.stat(path)
    lay = layout(path)
    meta = {
        k: v for k, v in lay.meta.items() if not isinstance(v, list)
    }  # per-layer lists: not what a model list shows
    params = lay.parameters
    arch = str(meta.get("general.architecture") or "")
    info = {k: v for k, v in meta.items() if k.startswith("general.") or (arch and k.startswith(arch + "."))}
    info["general.parameter_count"] = params
    ctx = meta.get(f"{arch}.context_length")
    ft = meta.get("general.file_type")
    return GgufFacts(
        architecture=arch,
        parameters=params,
        file_type=ft if isinstance(ft, int) else None,
        size_label=str(meta.get("general.size_label") or ""),
        template=str(meta.get("tokenizer.chat_template") or ""),
        info=info,
        context_length=ctx if isinstance(ctx, int) else None,
        size=st.st_size,
        mtime=st.st_mtime,
    )


_FACTS: dict[tuple[str, int, int], GgufFacts | None] = {}  # (path, size, mtime_ns): a changed file is read again


def facts(path: str | os.PathLike[str]) -> GgufFacts | None:
    """`read_facts`, cached; None when the file is missing here (a model on another node) or no GGUF."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _FACTS:
        try:
            _FACTS[key] = read_facts(path)
        except (OSError, ValueError, struct.error):
            _FACTS[key] = None
    return _FACTS[key]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class Digests:
    """Files' sha256s, each computed once per (path, size, mtime) in a thread; a blob's name or the catalogue's LFS
    etag (`known`) is taken as it is, without reading the file."""

    def __init__(self) -> None:
        self.done: dict[tuple[str, int, int], str] = {}
        self.running: dict[tuple[str, int, int], asyncio.Task[str]] = {}

    async def get(self, path: Path, known: str = "", wait_s: float = 2.0) -> str:
        """The file's sha256; "" when it is still being computed after `wait_s` (it goes on, for the next call)."""
        try:
            st = path.stat()
        except OSError:
            return ""
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key in self.done:
            return self.done[key]
        if m := BLOB_NAME.match(path.name):
            known = m.group(1)
        if SHA256_HEX.match(known):
            self.done[key] = known
            return known
        task = self.running.get(key)
        if task is None:
            task = self.running[key] = asyncio.ensure_future(asyncio.to_thread(sha256_of, path))
            task.add_done_callback(lambda t: self._finished(key, t))
        try:
            return await asyncio.wait_for(asyncio.shield(task), wait_s)
        except (TimeoutError, asyncio.TimeoutError):
            return ""
        except OSError:
            return ""

    def _finished(self, key: tuple[str, int, int], task: asyncio.Task[str]) -> None:
        self.running.pop(key, None)
        if not task.cancelled() and task.exception() is None:
            self.done[key] = task.result()
