"""The built-in catalogue, and how a pull spec (`<name>`, `<hf-repo>` or `<hf-repo>:<file>`) becomes a plan.

Repo ids and file names are the well-known ones on the Hugging Face Hub, written from memory (this code has not
been checked against the live Hub); sizes and memory figures are estimates for placement, not promises.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import msgspec

from coderai.catalog.errors import CatalogError
from coderai.contracts.families import FAMILIES

MB = 1 << 20


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One model a pull can name. `files` empty: the whole repo, filtered by `include`/`exclude` globs.
    `main`: the file the model's `path` points at ("" = the repo folder itself)."""

    name: str
    repo: str
    engine: str
    kind: str  # the op its family serves first: chat, embed, transcribe, speech, image, ...
    files: list[str] = []
    main: str = ""
    include: list[str] = []
    exclude: list[str] = []
    revision: str = "main"
    memory_mb: int = 0  # what one loaded copy needs; 0: estimated from the downloaded size
    size_mb: int = 0  # roughly what the download weighs
    params: dict[str, Any] = {}
    note: str = ""


def _gguf(name: str, repo: str, file: str, size_mb: int, memory_mb: int, n_ctx: int = 4096) -> Entry:
    return Entry(
        name=name,
        repo=repo,
        files=[file],
        main=file,
        engine="llama-server",
        kind="chat",
        size_mb=size_mb,
        memory_mb=memory_mb,
        params={"n_ctx": n_ctx},
    )


_ST_EXCLUDE = ["onnx/*", "openvino/*", "*.h5", "*.ot", "*.msgpack", "pytorch_model.bin", "*.onnx"]
_CT2 = ["config.json", "model.bin", "tokenizer.json", "vocabulary.txt", "preprocessor_config.json"]

BUILTIN: dict[str, Entry] = {
    e.name: e
    for e in [
        _gguf(
            "qwen2.5-0.5b-instruct", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q4_k_m.gguf", 491, 900
        ),
        _gguf(
            "qwen2.5-7b-instruct", "bartowski/Qwen2.5-7B-Instruct-GGUF", "Qwen2.5-7B-Instruct-Q4_K_M.gguf", 4680, 6400
        ),
        _gguf(
            "llama-3.2-1b-instruct",
            "bartowski/Llama-3.2-1B-Instruct-GGUF",
            "Llama-3.2-1B-Instruct-Q4_K_M.gguf",
            808,
            1400,
        ),
        _gguf(
            "llama-3.2-3b-instruct",
            "bartowski/Llama-3.2-3B-Instruct-GGUF",
            "Llama-3.2-3B-Instruct-Q4_K_M.gguf",
            2020,
            3000,
        ),
        _gguf(
            "mistral-7b-instruct",
            "bartowski/Mistral-7B-Instruct-v0.3-GGUF",
            "Mistral-7B-Instruct-v0.3-Q4_K_M.gguf",
            4370,
            6000,
        ),
        Entry(
            name="bge-small-en-v1.5",
            repo="BAAI/bge-small-en-v1.5",
            engine="embed",
            kind="embed",
            exclude=_ST_EXCLUDE,
            size_mb=134,
            memory_mb=400,
        ),
        Entry(
            name="all-minilm-l6-v2",
            repo="sentence-transformers/all-MiniLM-L6-v2",
            engine="embed",
            kind="embed",
            exclude=_ST_EXCLUDE,
            size_mb=91,
            memory_mb=350,
        ),
        *[
            Entry(
                name=f"whisper-{s}",
                repo=f"Systran/faster-whisper-{s}",
                engine="whisper",
                kind="transcribe",
                include=_CT2,
                size_mb=mb,
                memory_mb=mem,
            )
            for s, mb, mem in (("tiny", 75, 400), ("base", 145, 600), ("small", 484, 1400))
        ],
        Entry(
            name="piper-en-us-lessac-medium",
            repo="rhasspy/piper-voices",
            engine="tts",
            kind="speech",
            files=[
                "en/en_US/lessac/medium/en_US-lessac-medium.onnx",
                "en/en_US/lessac/medium/en_US-lessac-medium.onnx.json",
            ],
            main="en/en_US/lessac/medium/en_US-lessac-medium.onnx",
            size_mb=63,
            memory_mb=300,
        ),
        Entry(
            name="sd-turbo",
            repo="stabilityai/sd-turbo",
            engine="diffusers",
            kind="image",
            size_mb=2600,
            memory_mb=5000,
            exclude=["sd_turbo*.safetensors", "*.fp16.*", "*.bin", "*.ckpt", "*.onnx", "*.png", "*.jpg"],
            params={"steps": 1, "guidance_scale": 0.0},
        ),
    ]
}

KIND = {name: spec.ops[0] for name, spec in FAMILIES.items() if not spec.test_only}  # a family's first op


def parse_spec(spec: str) -> tuple[str, str]:
    """(`repo`, `file`) of `<repo>[:<file>]`; repo ids never hold a colon, file names may."""
    repo, _, file = spec.strip().partition(":")
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts) or ".." in file.split("/"):
        raise CatalogError(
            f"{spec!r} is neither a catalogue name nor <owner>/<repo>[:<file>] "
            f"(known names: {', '.join(sorted(BUILTIN))})"
        )
    return repo, file.strip("/")


def resolve(spec: str, name: str = "") -> Entry:
    """The entry a spec names: a catalogue name as it is, or an ad-hoc entry for a Hub repo (engine guessed later,
    from its files, when the spec does not say)."""
    if spec in BUILTIN:
        e = BUILTIN[spec]
        return msgspec.structs.replace(e, name=name) if name else e
    repo, file = parse_spec(spec)
    for e in BUILTIN.values():  # a known repo (and file) keeps its catalogue engine and params
        if e.repo == repo and (not file or file == e.main):
            return msgspec.structs.replace(e, name=name or e.name)
    default = (file.rsplit("/", 1)[-1].removesuffix(".gguf") if file else repo.split("/")[1]).lower()
    if file:
        engine = "llama-server" if file.endswith(".gguf") else ""
        return Entry(name=name or default, repo=repo, files=[file], main=file, engine=engine, kind=KIND.get(engine, ""))
    return Entry(name=name or default, repo=repo, engine="", kind="")


def select(entry: Entry, repo_files: list[str]) -> list[str]:
    """Which of a repo's files a whole-repo pull takes."""
    keep = [f for f in repo_files if not f.startswith(".") and f not in (".gitattributes",)]
    if entry.include:
        keep = [f for f in keep if any(fnmatch.fnmatch(f, p) for p in entry.include)]
    if entry.exclude:
        keep = [f for f in keep if not any(fnmatch.fnmatch(f, p) for p in entry.exclude)]
    ggufs = [f for f in keep if f.endswith(".gguf")]
    if len(ggufs) > 1:
        raise CatalogError(
            f"{entry.repo} holds {len(ggufs)} GGUF files; pick one as {entry.repo}:<file>: "
            + ", ".join(sorted(ggufs)[:12])
            + (" ..." if len(ggufs) > 12 else "")
        )
    if ggufs:
        return ggufs
    return [f for f in keep if f not in ("README.md",) and not f.endswith((".md", ".png", ".jpg", ".gif"))]


def guess_engine(files: list[str]) -> tuple[str, str, str]:
    """(engine, kind, main file) from a pulled file list; ("", "", "") when nothing matches."""
    names = {f.rsplit("/", 1)[-1] for f in files}
    ggufs = [f for f in files if f.endswith(".gguf")]
    if ggufs:
        return "llama-server", "chat", ggufs[0]
    if "model.bin" in names and "tokenizer.json" in names:
        return "whisper", "transcribe", ""
    if "model_index.json" in names:
        return "diffusers", "image", ""
    if names & {"modules.json", "sentence_bert_config.json"}:
        return "embed", "embed", ""
    onnx = [f for f in files if f.endswith(".onnx") and f + ".json" in files]
    if onnx:
        return "tts", "speech", onnx[0]
    return "", "", ""
