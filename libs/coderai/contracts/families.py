"""One `FamilySpec` per engine family: every table about families (the ops each serves by default, the class a
worker runs it with and what it must be able to import, its params with their types and ranges, whether it loads
GGUF files, where it runs and how one copy may use several cards) derives from `FAMILIES`. Adding a family is its
engine module (`engine_worker/engines/`), its name in `EngineFamily` and one entry here, with its test
(docs/architecture.md, "How to add").

Read by the worker (which families it can run, and with what), the scheduler (sizing and placement), the params
checks (`coderai.engine_params`), the catalogue (what kind of model a family makes) and the models file.

A family from outside the package: a module named in `CODERAI_FAMILIES` (comma-separated, importable by every
head service and worker, all of which must have the setting) declares `FAMILY = FamilySpec(...)`, whose `runner`
is its `Engine` class in a module of its own. The declaring module is read while this one loads, so it may import
only `coderai.contracts.families`, `.params` and `.jobs` (tests/contracts/test_families.py runs one end to end)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from coderai.contracts.jobs import EngineOp, Op
from coderai.contracts.params import (
    ARGS,
    BOOL,
    CTX,
    DEVICE,
    ENV,
    KV_TYPES,
    MAX_NESTED,
    MAX_TEMPLATE,
    PATH,
    THREADS,
    TIMEOUT,
    TORCH_DTYPE,
    P,
    choice,
    num,
    whole,
)

BuiltinFamily = Literal[
    "llama",
    "llama-server",
    "vllm",
    "sglang",
    "mlx",
    "embed",
    "diffusers",
    "whisper",
    "whispercpp",
    "tts",
    "diarize",
    "ocr",
    "video",
    "transformers",
    "remote",
    "host",
    "echo",
]
"""The families of this package: exactly the keys of `FAMILIES` without `CODERAI_FAMILIES`."""
PLUGINS_ENV = "CODERAI_FAMILIES"

Device = Literal["gpu", "cpu", "cpu_unless_asked"]
Cards = Literal["", "split", "ranks"]


@dataclass(frozen=True)
class FamilySpec:
    """What coderai knows about one engine family.

    `runner`: `module:Class` of the `Engine` a worker runs it with, imported only when a model of it is assigned.
    `needs`: the module a worker must be able to import to offer it ("": the runner's own check, a binary).
    `ops`: what a model of it answers unless its config says (`ModelConfig.ops`); the first is its catalogue kind.
    `params`: every param a model of it may set, with its type and range; anything else is refused.
    `gguf`: loads llama.cpp's GGUF files (sized from their metadata, split over RPC servers).
    `device`: `gpu` (on a GPU when the node has one), `cpu` (never), `cpu_unless_asked` (only when its `device`
    param names one). `cards`: how one copy may use several cards: `split` (by their room, llama.cpp's tensor
    split), `ranks` (one card per rank, vLLM), `` (one card). `test_only`: offered only when a worker's settings
    name it (`CODERAI_WORKER_FAMILIES`), never from what is installed."""

    name: str
    runner: str
    needs: str
    ops: tuple[EngineOp, ...]
    params: Mapping[str, P]
    gguf: bool = False
    device: Device = "gpu"
    cards: Cards = ""
    test_only: bool = False


_LLM: tuple[EngineOp, ...] = ("chat", "complete")
_ENGINES = "coderai.engine_worker.engines"

# llama.cpp's own params: read by both the server and the in-process engine
_LLAMA_COMMON: dict[str, P] = {
    "n_ctx": CTX,
    "n_threads": THREADS,
    "n_threads_batch": THREADS,
    "n_batch": whole(1, 1 << 20),
    "n_ubatch": whole(1, 1 << 20),
    "n_gpu_layers": whole(-1, 100_000),
    "main_gpu": whole(0, 64),
    "seed": whole(-1, 2**32 - 1),
    "embedding": BOOL,
    "pooling": choice("none", "mean", "cls", "last", "rank"),
    "mmproj": PATH,
    "chat_template": P("str", size=MAX_TEMPLATE),
    "prompt_cache_mb": num(0, 1 << 20),
    "rope_freq_base": num(0, 1e9),
    "rope_freq_scale": num(0, 1e3),
}
# a child server's crash-loop quarantine (engines/child_server.py): parked after `crash_limit` deaths within
# `crash_window_s`, until its model is placed anew
_SUPERVISED: dict[str, P] = {"crash_limit": whole(1, 1000), "crash_window_s": num(1, 7 * 86_400)}
_PICTURES: dict[str, P] = {
    "threads": THREADS,
    "device": DEVICE,
    "dtype": TORCH_DTYPE,
    "max_pixels": whole(64, 1 << 28),
    "steps": whole(1, 1000),
    "max_steps": whole(1, 1000),
    "guidance_scale": num(0, 100),
}

FAMILIES: dict[str, FamilySpec] = {
    s.name: s
    for s in (
        FamilySpec(
            "llama-server",
            f"{_ENGINES}.llama_server:LlamaServerEngine",
            "",
            _LLM,
            gguf=True,
            cards="split",
            params={
                **_LLAMA_COMMON,
                "head_snapshots_mb": whole(0, 1 << 24),
                "base": PATH,  # a fine-tuned model: `path` is its LoRA adapter, this the base model's GGUF
                "hf_path": PATH,  # the Hugging Face folder the GGUF was made from: fine-tuning trains on it
                "parallel": whole(1, 1024),
                "cache_ram_mb": whole(0, 1 << 24),
                "queue": whole(0, 1 << 20),
                "load_timeout_s": TIMEOUT,
                "env": ENV,
                "extra_args": ARGS,
                "flash_attn": choice("on", "off", "auto"),
                "cache_type_k": choice(*KV_TYPES),
                "cache_type_v": choice(*KV_TYPES),
                "rope_scaling": choice("none", "linear", "yarn"),
                "no_kv_offload": BOOL,
                "cont_batching": BOOL,
                "no_cont_batching": BOOL,
                "defrag_thold": num(-1, 1),
                "cache_reuse": whole(0, 1 << 20),
                "swa_full": BOOL,
                "kv_unified": BOOL,
                "no_context_shift": BOOL,
                "context_shift": BOOL,
                "keep": whole(-1, 1 << 24),
                "reasoning_format": choice("none", "deepseek", "deepseek-legacy", "auto"),
                "reasoning_budget": whole(-1, 1 << 20),
                "n_predict": whole(-1, 1 << 24),
                "model_draft": PATH,
                "n_gpu_layers_draft": whole(-1, 100_000),
                "draft_max": whole(0, 1024),
                "draft_min": whole(0, 1024),
                "draft_p_min": num(0, 1),
                "split_mode": choice("none", "layer", "row"),
                "tensor_split": P("str"),
                "temp": num(0, 100),
                "top_k": whole(0, 1 << 20),
                "top_p": num(0, 1),
                "min_p": num(0, 1),
                "repeat_penalty": num(0, 100),
                "threads_http": THREADS,
                **_SUPERVISED,
            },
        ),
        FamilySpec(
            "llama",
            f"{_ENGINES}.llama:LlamaEngine",
            "llama_cpp",
            _LLM,
            gguf=True,
            cards="split",
            params={
                **_LLAMA_COMMON,
                "pooling_type": whole(-1, 4),
                "chat_format": P("str"),
                "flash_attn": BOOL,
                "use_mmap": BOOL,
                "use_mlock": BOOL,
                "offload_kqv": BOOL,
                "type_k": whole(0, 64),
                "type_v": whole(0, 64),
                "split_mode": whole(0, 2),
                "tensor_split": P("list"),
                "verbose": BOOL,
                "logits_all": BOOL,
                "last_n_tokens_size": whole(0, 1 << 20),
            },
        ),
        FamilySpec(
            "vllm",
            f"{_ENGINES}.vllm:VllmEngine",
            "vllm",
            _LLM,
            cards="ranks",
            params={
                "dtype": choice("auto", "half", "float16", "bfloat16", "float", "float32"),
                "max_model_len": CTX,
                "gpu_memory_utilization": num(0.01, 1.0),
                "tensor_parallel_size": whole(1, 1024),
                "pipeline_parallel_size": whole(1, 1024),
                "enforce_eager": BOOL,
                "enable_log_requests": BOOL,
                "max_num_seqs": whole(1, 1 << 20),
                "max_num_batched_tokens": whole(1, 1 << 24),
                "enable_prefix_caching": BOOL,
                "enable_chunked_prefill": BOOL,
                # tools: vLLM takes a tool_choice other than "none" only with both set (a named or "required" one is
                # then guided decoding, whatever the model)
                "tool_call_parser": P("str", size=64),
                "enable_auto_tool_choice": BOOL,
                "seed": whole(0, 2**32 - 1),
                "swap_space": num(0, 1 << 20),
                "cpu_offload_gb": num(0, 1 << 20),
                "block_size": whole(1, 1024),
                "num_gpu_blocks_override": whole(1, 1 << 24),  # the KV cache's size in blocks, whatever memory says
                "kv_events": BOOL,  # its KV-cache events to the worker (engines/kv_events.py): on unless false
                "kv_cache_dtype": choice("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"),
                "quantization": P("str", size=64),
                "max_logprobs": whole(0, 1 << 20),
                "tokenizer": PATH,
                "generation_config": P("str", size=64),
                "load_timeout_s": TIMEOUT,
                "ray_port": whole(1024, 65535),
                "ray_join_timeout_s": TIMEOUT,
                "python": PATH,
                "env": ENV,
                "extra_args": ARGS,
                "trust_remote_code": BOOL,
                "base": PATH,  # a fine-tuned model: `path` is its LoRA adapter, this the base model's folder
                # LoRA on: fine-tuned models of this base on the same node load into this server at run time
                "enable_lora": BOOL,
                "max_lora_rank": choice(8, 16, 32, 64, 128, 256, 320, 512),
                "max_loras": whole(1, 1024),
                "max_cpu_loras": whole(1, 1 << 16),
                **_SUPERVISED,
            },
        ),
        # mlx_lm.server as a child: Apple silicon, or a Linux CPU with mlx[cpu]; never given a CUDA card
        FamilySpec(
            "mlx",
            f"{_ENGINES}.mlx:MlxEngine",
            "mlx_lm",
            _LLM,
            device="cpu",
            params={
                "max_tokens": whole(1, 1 << 20),
                "chat_template": P("str", size=MAX_TEMPLATE),
                "use_default_chat_template": BOOL,
                "chat_template_args": P("table", size=MAX_NESTED),
                "trust_remote_code": BOOL,
                "adapter_path": PATH,
                "draft_model": PATH,
                "num_draft_tokens": whole(1, 1024),
                "temp": num(0, 100),
                "top_p": num(0, 1),
                "top_k": whole(0, 1 << 20),
                "min_p": num(0, 1),
                "decode_concurrency": whole(1, 4096),
                "prompt_concurrency": whole(1, 4096),
                "prefill_step_size": whole(1, 1 << 20),
                "prompt_cache_size": whole(0, 1 << 20),
                "prompt_cache_bytes": whole(0, 1 << 50),
                "kv_bits": choice(2, 3, 4, 5, 6, 8),
                "kv_group_size": choice(32, 64, 128),
                "quantized_kv_start": whole(0, 1 << 24),
                "log_level": choice("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                "load_timeout_s": TIMEOUT,
                "env": ENV,
                "extra_args": ARGS,
                **_SUPERVISED,
            },
        ),
        # SGLang's OpenAI server, in a venv of its own; ktransformers' CPU/GPU expert split through its kt_* params
        # (engines/sglang.py); over several nodes as vLLM's ranks are planned
        FamilySpec(
            "sglang",
            f"{_ENGINES}.sglang:SGLangEngine",
            "",
            _LLM,
            cards="ranks",
            params={
                "tp_size": whole(1, 1024),
                "pp_size": whole(1, 1024),
                "dp_size": whole(1, 1024),
                "ep_size": whole(1, 1024),
                "mem_fraction_static": num(0.01, 1.0),
                "context_length": CTX,
                "max_running_requests": whole(1, 1 << 20),
                "max_total_tokens": whole(1, 1 << 30),
                "chunked_prefill_size": whole(-1, 1 << 24),
                "dtype": choice("auto", "half", "float16", "bfloat16", "float", "float32"),
                "kv_cache_dtype": P("str", size=32),
                "quantization": P("str", size=64),
                "attention_backend": P("str", size=64),
                "trust_remote_code": BOOL,
                "disable_radix_cache": BOOL,
                "enable_torch_compile": BOOL,
                "schedule_policy": choice("lpm", "random", "fcfs", "dfs-weight", "lof", "priority"),
                "random_seed": whole(0, 2**31 - 1),
                "tool_call_parser": P("str", size=64),
                "reasoning_parser": P("str", size=64),
                "kt_weight_path": PATH,
                "kt_method": P("str", size=32),
                "kt_cpuinfer": whole(1, 4096),
                "kt_threadpool_count": whole(1, 64),
                "kt_num_gpu_experts": whole(0, 1 << 16),
                "dist_port": whole(1024, 65535),
                "load_timeout_s": TIMEOUT,
                "python": PATH,
                "env": ENV,
                "extra_args": ARGS,
                **_SUPERVISED,
            },
        ),
        FamilySpec(
            "embed",
            f"{_ENGINES}.embed:EmbedEngine",
            "sentence_transformers",
            ("embed", "rerank"),
            device="cpu_unless_asked",
            params={"threads": THREADS, "batch_size": whole(1, 1 << 16), "device": DEVICE, "cross_encoder": BOOL},
        ),
        FamilySpec(
            "diffusers",
            f"{_ENGINES}.diffusion:ImageEngine",
            "diffusers",
            ("image",),
            params={**_PICTURES, "max_n": whole(1, 10)},
        ),
        FamilySpec(
            "video",
            f"{_ENGINES}.diffusion:VideoEngine",
            "diffusers",
            ("video",),
            params={**_PICTURES, "max_frames": whole(1, 1 << 14), "stages": P("int_or_bool", 1, 64)},
        ),
        FamilySpec(
            "whisper",
            f"{_ENGINES}.whisper:WhisperEngine",
            "faster_whisper",
            ("transcribe",),
            device="cpu_unless_asked",
            params={
                "device": DEVICE,
                "compute_type": P("str", size=32),
                "threads": THREADS,
                "workers": whole(1, 256),
                "max_audio_s": num(1, 7 * 86_400),
                "beam_size": whole(1, 64),
                "best_of": whole(1, 64),
                "patience": num(0, 100),
                "length_penalty": num(-100, 100),
                "repetition_penalty": num(0, 100),
                "no_repeat_ngram_size": whole(0, 64),
                "compression_ratio_threshold": num(0, 100),
                "log_prob_threshold": num(-100, 100),
                "no_speech_threshold": num(0, 1),
                "condition_on_previous_text": BOOL,
                "vad_filter": BOOL,
                "vad_parameters": P("table"),
                "hallucination_silence_threshold": num(0, 3600),
                "chunk_length": whole(1, 3600),
            },
        ),
        # whisper.cpp in the worker's process (engines/whispercpp.py); the PyPI wheel is built for the CPU only
        FamilySpec(
            "whispercpp",
            f"{_ENGINES}.whispercpp:WhisperCppEngine",
            "pywhispercpp",
            ("transcribe",),
            device="cpu",
            params={
                "threads": THREADS,
                "max_audio_s": num(1, 7 * 86_400),
                "beam_size": whole(1, 8),  # whisper.cpp runs at most 8 decoders
                "best_of": whole(1, 8),
                "condition_on_previous_text": BOOL,
                "entropy_threshold": num(0, 100),
                "log_prob_threshold": num(-100, 100),
                "no_speech_threshold": num(0, 1),
                "suppress_non_speech": BOOL,
            },
        ),
        FamilySpec(
            "tts", f"{_ENGINES}.tts:PiperEngine", "piper", ("speech",), device="cpu", params={"config_path": PATH}
        ),
        FamilySpec(
            "diarize",
            f"{_ENGINES}.diarize:DiarizeEngine",
            "resemblyzer",
            ("diarize",),
            device="cpu_unless_asked",
            params={
                "device": DEVICE,
                "threads": THREADS,
                "max_audio_s": num(1, 7 * 86_400),
                "window_s": num(0.1, 60),
                "hop_s": num(0.01, 60),
                "min_segment_s": num(0, 3600),
                "min_speaker_s": num(0, 3600),
                "max_speakers": whole(1, 256),
                "separation_threshold": num(0, 100),
            },
        ),
        FamilySpec(
            "ocr",
            f"{_ENGINES}.ocr:OcrEngine",
            "rapidocr",
            ("ocr",),
            device="cpu",
            params={
                "threads": THREADS,
                "scale": num(0.1, 16),
                "max_pages": whole(1, 100_000),
                "max_side": whole(64, 1 << 16),
                "rapidocr": P("table"),
            },
        ),
        FamilySpec(
            "transformers",
            f"{_ENGINES}.hf_chat:TransformersEngine",
            "transformers",
            _LLM,
            params={"base": PATH, "dtype": TORCH_DTYPE, "device": DEVICE, "max_tokens": whole(1, 1 << 20)},
        ),
        # OpenAI-compatible endpoints elsewhere, relayed by the worker that holds the copy (engines/remote.py)
        FamilySpec(
            "remote",
            f"{_ENGINES}.remote:RemoteEngine",
            "coderai.engine_worker",
            _LLM,
            device="cpu",
            params={
                "service_url": P("str", size=2048),
                "service_urls": P("list", size=MAX_NESTED),
                "served_model": P("str", size=256),
                "api_key_secret": P("str", size=128),
                "timeout_s": TIMEOUT,
                "max_answer_mb": num(0.001, 1024),
                "down_s": num(0, 3600),
                "concurrency": whole(1, 4096),
            },
        ),
        # hosts started on demand by the commands of the worker's own pools file, never by params
        # (engines/host_engine.py, engines/host_pool.py)
        FamilySpec(
            "host",
            f"{_ENGINES}.host_engine:HostPoolEngine",
            "coderai.engine_worker",
            _LLM,
            device="cpu",
            params={
                "pool": P("str", size=64),
                "served_model": P("str", size=256),
                "api_key_secret": P("str", size=128),
                "timeout_s": TIMEOUT,
                "max_answer_mb": num(0.001, 1024),
                "concurrency": whole(1, 4096),
            },
        ),
        FamilySpec(
            "echo",
            f"{_ENGINES}.echo:EchoEngine",
            "coderai.engine_worker",
            _LLM,
            device="cpu",
            test_only=True,
            params={
                "reply": P("str", size=MAX_TEMPLATE),
                "token_delay_s": num(0, 60),
                "slots": whole(1, 1024),
                "tool_calls": P("table", size=MAX_NESTED),
            },
        ),
    )
}


def _plugins(names: str) -> list[FamilySpec]:
    """The `FAMILY` of each module in `names` (comma-separated)."""
    out: list[FamilySpec] = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        spec = getattr(importlib.import_module(name), "FAMILY", None)
        if not isinstance(spec, FamilySpec):
            raise ImportError(f"{name} (named in {PLUGINS_ENV}) declares no FAMILY = FamilySpec(...)")
        if spec.name in FAMILIES or any(s.name == spec.name for s in out):
            raise ImportError(f"{name} (named in {PLUGINS_ENV}) declares family {spec.name!r}, which exists")
        out.append(spec)
    return out


FAMILIES.update((s.name, s) for s in _plugins(os.environ.get(PLUGINS_ENV, "")))

if TYPE_CHECKING:
    EngineFamily = BuiltinFamily
else:  # what a model's `engine` is checked against when a config is decoded: every family, added ones too
    EngineFamily = Literal[tuple(FAMILIES)]

GGUF_FAMILIES: frozenset[str] = frozenset(s.name for s in FAMILIES.values() if s.gguf)
DEFAULT_OPS: dict[str, list[Op]] = {n: list(s.ops) for n, s in FAMILIES.items()}
CPU_FAMILIES = frozenset(n for n, s in FAMILIES.items() if s.device == "cpu")
CPU_UNLESS_ASKED = frozenset(n for n, s in FAMILIES.items() if s.device == "cpu_unless_asked")


def family(name: str) -> FamilySpec | None:
    """The spec of family `name`, or None for a name no worker knows."""
    return FAMILIES.get(name)
