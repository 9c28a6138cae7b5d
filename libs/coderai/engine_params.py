"""The params each engine family takes, with their types and ranges: a model's `params` are data, never a command
line. A server family (llama-server, vLLM) turns each param it does not read itself into a `--flag value` of its
child, so a param outside its table would be a flag nobody checked (`host` binds the child on every interface,
`log_file` writes any file, `trust_remote_code` runs a repository's Python): every param is looked up here first,
and anything else is refused, naming it.

Where the checks are made:
- the admin API and the scheduler's add/replace subject (`check(..., operator=False)`): a 400 naming the param;
- a worker, for every model an assignment brings it (`check` again, over the bus): a refused model is not loaded,
  and its engine is reported failed with the reason;
- EXEC params (what program runs, its environment, its raw arguments, remote code) come only from a models file
  the operator wrote: never from the API, and a worker honours them only when its own settings say so
  (`CODERAI_WORKER_BUS_EXEC`, which `coderai up` sets for its own worker).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

EXEC_PARAMS = frozenset({"python", "env", "extra_args", "trust_remote_code"})
"""Params that choose a program, its environment or arguments, or run a repository's code: the operator's only."""

MAX_TEXT = 4096  # a string param's length at most (a path, a name, a list of numbers)
MAX_TEMPLATE = 65536  # a chat template's (an inline Jinja template)
MAX_NESTED = 16384  # a list or table param's encoded size at most (echo's tool script, rapidocr's options)


class ParamError(ValueError):
    """A param a family does not take, or a value out of its type or range; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class P:
    """One param: its kind (int, float, bool, str, path, choice, list, table, int_or_bool), range and choices."""

    kind: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple[Any, ...] = ()
    size: int = MAX_TEXT


def _int(lo: float, hi: float) -> P:
    return P("int", lo, hi)


def _num(lo: float, hi: float) -> P:
    return P("float", lo, hi)


def _choice(*choices: Any) -> P:
    return P("choice", choices=choices)


BOOL = P("bool")
PATH = P("path")
THREADS = _int(1, 1024)
DEVICE = P("str")  # cpu, cuda, cuda:1, mps
TIMEOUT = _num(1, 86_400)
TORCH_DTYPE = _choice("float32", "float16", "bfloat16", "auto")
CTX = _int(16, 1 << 24)
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
ENV = P("table", size=MAX_NESTED)
ARGS = P("list", size=MAX_NESTED)

# llama.cpp's own: read by both the server and the in-process engine
_LLAMA_COMMON: dict[str, P] = {
    "n_ctx": CTX, "n_threads": THREADS, "n_threads_batch": THREADS, "n_batch": _int(1, 1 << 20),
    "n_ubatch": _int(1, 1 << 20), "n_gpu_layers": _int(-1, 100_000), "main_gpu": _int(0, 64),
    "seed": _int(-1, 2**32 - 1), "embedding": BOOL, "pooling": _choice("none", "mean", "cls", "last", "rank"),
    "mmproj": PATH, "chat_template": P("str", size=MAX_TEMPLATE), "prompt_cache_mb": _num(0, 1 << 20),
    "rope_freq_base": _num(0, 1e9), "rope_freq_scale": _num(0, 1e3),
}

FAMILY_PARAMS: dict[str, dict[str, P]] = {
    "llama-server": {
        **_LLAMA_COMMON,
        "head_snapshots_mb": _int(0, 1 << 24),
        "parallel": _int(1, 1024), "cache_ram_mb": _int(0, 1 << 24), "queue": _int(0, 1 << 20),
        "load_timeout_s": TIMEOUT, "env": ENV, "extra_args": ARGS,
        "flash_attn": _choice("on", "off", "auto"), "cache_type_k": _choice(*KV_TYPES),
        "cache_type_v": _choice(*KV_TYPES), "rope_scaling": _choice("none", "linear", "yarn"),
        "no_kv_offload": BOOL, "cont_batching": BOOL, "no_cont_batching": BOOL,
        "defrag_thold": _num(-1, 1), "cache_reuse": _int(0, 1 << 20), "swa_full": BOOL, "kv_unified": BOOL,
        "no_context_shift": BOOL, "context_shift": BOOL, "keep": _int(-1, 1 << 24),
        "reasoning_format": _choice("none", "deepseek", "deepseek-legacy", "auto"),
        "reasoning_budget": _int(-1, 1 << 20), "n_predict": _int(-1, 1 << 24),
        "model_draft": PATH, "n_gpu_layers_draft": _int(-1, 100_000), "draft_max": _int(0, 1024),
        "draft_min": _int(0, 1024), "draft_p_min": _num(0, 1),
        "split_mode": _choice("none", "layer", "row"), "tensor_split": P("str"),
        "temp": _num(0, 100), "top_k": _int(0, 1 << 20), "top_p": _num(0, 1), "min_p": _num(0, 1),
        "repeat_penalty": _num(0, 100), "threads_http": THREADS,
    },
    "llama": {
        **_LLAMA_COMMON,
        "pooling_type": _int(-1, 4), "chat_format": P("str"), "flash_attn": BOOL, "use_mmap": BOOL,
        "use_mlock": BOOL, "offload_kqv": BOOL, "type_k": _int(0, 64), "type_v": _int(0, 64),
        "split_mode": _int(0, 2), "tensor_split": P("list"), "verbose": BOOL, "logits_all": BOOL,
        "last_n_tokens_size": _int(0, 1 << 20),
    },
    "vllm": {
        "dtype": _choice("auto", "half", "float16", "bfloat16", "float", "float32"),
        "max_model_len": CTX, "gpu_memory_utilization": _num(0.01, 1.0), "tensor_parallel_size": _int(1, 1024),
        "pipeline_parallel_size": _int(1, 1024), "enforce_eager": BOOL, "enable_log_requests": BOOL,
        "max_num_seqs": _int(1, 1 << 20), "max_num_batched_tokens": _int(1, 1 << 24),
        "enable_prefix_caching": BOOL, "enable_chunked_prefill": BOOL, "seed": _int(0, 2**32 - 1),
        "swap_space": _num(0, 1 << 20), "cpu_offload_gb": _num(0, 1 << 20), "block_size": _int(1, 1024),
        "kv_cache_dtype": _choice("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"),
        "quantization": P("str", size=64), "max_logprobs": _int(0, 1 << 20), "tokenizer": PATH,
        "generation_config": P("str", size=64), "load_timeout_s": TIMEOUT,
        "ray_port": _int(1024, 65535), "ray_join_timeout_s": TIMEOUT,
        "python": PATH, "env": ENV, "extra_args": ARGS, "trust_remote_code": BOOL,
    },
    "embed": {"threads": THREADS, "batch_size": _int(1, 1 << 16), "device": DEVICE, "cross_encoder": BOOL},
    "diffusers": {"threads": THREADS, "device": DEVICE, "dtype": TORCH_DTYPE, "max_pixels": _int(64, 1 << 28),
                  "steps": _int(1, 1000), "max_steps": _int(1, 1000), "max_n": _int(1, 10),
                  "guidance_scale": _num(0, 100)},
    "video": {"threads": THREADS, "device": DEVICE, "dtype": TORCH_DTYPE, "max_pixels": _int(64, 1 << 28),
              "steps": _int(1, 1000), "max_steps": _int(1, 1000), "guidance_scale": _num(0, 100),
              "max_frames": _int(1, 1 << 14),
              "stages": P("int_or_bool", 1, 64)},
    "whisper": {"device": DEVICE, "compute_type": P("str", size=32), "threads": THREADS, "workers": _int(1, 256),
                "max_audio_s": _num(1, 7 * 86_400), "beam_size": _int(1, 64), "best_of": _int(1, 64),
                "patience": _num(0, 100), "length_penalty": _num(-100, 100), "repetition_penalty": _num(0, 100),
                "no_repeat_ngram_size": _int(0, 64), "compression_ratio_threshold": _num(0, 100),
                "log_prob_threshold": _num(-100, 100), "no_speech_threshold": _num(0, 1),
                "condition_on_previous_text": BOOL, "vad_filter": BOOL, "vad_parameters": P("table"),
                "hallucination_silence_threshold": _num(0, 3600), "chunk_length": _int(1, 3600)},
    "tts": {"config_path": PATH},
    "diarize": {"device": DEVICE, "threads": THREADS, "max_audio_s": _num(1, 7 * 86_400),
                "window_s": _num(0.1, 60), "hop_s": _num(0.01, 60), "min_segment_s": _num(0, 3600),
                "min_speaker_s": _num(0, 3600), "max_speakers": _int(1, 256), "separation_threshold": _num(0, 100)},
    "ocr": {"threads": THREADS, "scale": _num(0.1, 16), "max_pages": _int(1, 100_000), "max_side": _int(64, 1 << 16),
            "rapidocr": P("table")},
    "transformers": {"base": PATH, "dtype": TORCH_DTYPE, "device": DEVICE, "max_tokens": _int(1, 1 << 20)},
    "echo": {"reply": P("str", size=MAX_TEMPLATE), "token_delay_s": _num(0, 60), "slots": _int(1, 1024),
             "tool_calls": P("table", size=MAX_NESTED)},
}


def _show(x: float | None) -> str:
    return "?" if x is None else str(int(x)) if float(x).is_integer() else f"{x:g}"


def _fits(spec: P, value: Any) -> str | None:
    """Why `value` is not a `spec`, or None when it is."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if spec.kind in ("int", "float", "int_or_bool"):
        if spec.kind == "int_or_bool" and isinstance(value, bool):
            return None
        if not number or (spec.kind != "float" and not float(value).is_integer()):
            return f"must be {'a number' if spec.kind == 'float' else 'a whole number'}"
        if not math.isfinite(value) or (spec.lo is not None and value < spec.lo) or (spec.hi is not None and value > spec.hi):
            return f"must be between {_show(spec.lo)} and {_show(spec.hi)}"
        return None
    if spec.kind == "bool":
        return None if isinstance(value, bool) else "must be true or false"
    if spec.kind == "choice":
        return None if value in spec.choices else f"must be one of {', '.join(map(str, spec.choices))}"
    if spec.kind in ("str", "path"):
        if not isinstance(value, str):
            return "must be a string"
        if "\0" in value or len(value) > spec.size:
            return f"must be a string of at most {spec.size} characters"
        return None
    if spec.kind in ("list", "table"):
        if not isinstance(value, list if spec.kind == "list" else dict):
            return "must be a list" if spec.kind == "list" else "must be a table"
        import msgspec

        return None if len(msgspec.json.encode(value)) <= spec.size else f"is over {spec.size} bytes"
    return "has no known kind"


def check(engine: str, params: dict[str, Any], *, operator: bool) -> None:
    """Raise ParamError naming the first param of `params` that family `engine` does not take (or not from this
    source: EXEC params only when `operator`, a models file the operator wrote), or whose value is out of its
    type or range. A family this table does not know is the worker's to refuse ("no engine family")."""
    table = FAMILY_PARAMS.get(engine)
    if table is None:
        return
    for name, value in params.items():
        where = f"params.{name}"
        if name in EXEC_PARAMS and not operator:
            raise ParamError(where, f"params.{name} chooses what runs on a node (a program, its environment or "
                                    "arguments, or a repository's code): only a models file the operator writes may "
                                    "set it, never the API or the bus")
        spec = table.get(name)
        if spec is None:
            raise ParamError(where, f"engine {engine} takes no param {name!r} (it takes "
                                    f"{', '.join(sorted(set(table) - EXEC_PARAMS))})")
        if value is None:
            continue
        why = _fits(spec, value)
        if why is not None:
            raise ParamError(where, f"params.{name} {why}, not {str(value)[:80]!r}")


def takes(engine: str) -> list[str]:
    """The params family `engine` takes from anyone (the EXEC ones left out)."""
    return sorted(set(FAMILY_PARAMS.get(engine, {})) - EXEC_PARAMS)
