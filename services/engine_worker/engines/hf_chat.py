"""Engine family `transformers`: a Hugging Face causal LM (a folder), optionally with a peft LoRA adapter, for chat
and completions. It serves fine-tuned models (`<base>:<suffix>-<id>`, see docs/finetuning.md) and small HF models
that have no GGUF; llama.cpp and vLLM stay the fast paths.

Config: `path` is the model folder, or, with `params.base` naming the base folder, the adapter (a tar of the peft
folder as the fine-tuning job stores it, or a folder). `params.dtype` (float32 default on CPU, bfloat16 on a GPU),
`params.device` (`cpu` keeps it off a GPU it would take otherwise) and `params.max_tokens` (the default answer
length, 256) are optional.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coderai.contracts import (
    ChatJob,
    Choice,
    CompletionJob,
    ModelConfig,
    SamplingParams,
    Usage,
)
from coderai.contracts.jobs import FinishReason
from coderai.engine_worker.engines.base import CancelFlag, Engine, EngineLoadError, one_prompt, to_device

Emit = Callable[[dict | None, str | None, FinishReason | None], None]


def extract_data(tar: tarfile.TarFile, dest: Path) -> None:
    """Unpack `tar` into `dest` as plain files and folders only: no absolute path, nothing outside `dest`, no
    link or device (tarfile's "data" filter; checked by hand where Python predates it, as Debian 12's 3.11.2 does)."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter="data")
        return
    root = dest.resolve()
    members = tar.getmembers()
    for m in members:
        target = (root / m.name).resolve()
        if not (m.isfile() or m.isdir()) or os.path.isabs(m.name) or not target.is_relative_to(root):
            raise ValueError(f"refusing {m.name!r} in {tar.name}: only plain files and folders inside it")
    tar.extractall(dest, members=members)  # every member checked above


def unpack_adapter(path: Path) -> Path:
    """The adapter folder of `path`: itself when a folder, else the tar unpacked once beside it (into a hidden
    folder named by the tar's digest, renamed into place whole)."""
    if path.is_dir():
        return path
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()[:16]
    dest = path.with_name(f".{path.name}.{digest}")
    if dest.is_dir():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    with tarfile.open(path) as tar:
        extract_data(tar, tmp)
    try:
        tmp.rename(dest)
    except OSError:  # another loader got there first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return dest


class TransformersEngine(Engine):
    family = "transformers"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model: Any = None
        self.tok: Any = None

    def load(self) -> None:
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as exc:
            raise EngineLoadError(f"the transformers engine needs torch and transformers: {exc}") from None
        p = self.config.params
        base = os.path.expanduser(str(p.get("base") or self.config.path))
        adapter = os.path.expanduser(self.config.path) if p.get("base") else ""
        cuda = torch.cuda.is_available() and not str(p.get("device") or "").lower().startswith("cpu")
        dtype = getattr(torch, str(p.get("dtype") or ("bfloat16" if cuda else "float32")))
        try:
            self.tok = AutoTokenizer.from_pretrained(base)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        except (OSError, ValueError) as exc:
            raise EngineLoadError(f"transformers could not load {base}: {exc}") from None
        if adapter:
            try:
                from peft import PeftModel
            except ImportError:
                raise EngineLoadError("serving a LoRA adapter needs peft (the `finetune` extra)") from None
            try:
                folder = unpack_adapter(Path(adapter))
                model = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()  # merged: plain speed
            except (OSError, ValueError, tarfile.TarError) as exc:
                raise EngineLoadError(f"could not load the adapter {adapter}: {exc}") from None
        self.device = torch.device("cuda", (self.config.devices or [0])[0]) if cuda else torch.device("cpu")
        self.model = to_device(model, self.device).eval()
        # transformers 5 renamed the KV cache argument (`past_key_values` -> `cache`)
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.eos = {*eos_ids, self.tok.eos_token_id} - {None}

    def close(self) -> None:
        self.model = None
        self.tok = None

    def chat(self, job: ChatJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        try:
            prompt = self.tok.apply_chat_template(job.messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja raises its own types for messages a template refuses
            raise ValueError(f"the model's chat template refused these messages: {exc}") from None
        ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        if emit is not None:  # one choice, streamed: the first delta names the role
            first = [True]

            def piece(text: str) -> None:
                emit({"role": "assistant", "content": text} if first[0] else {"content": text}, None, None)
                first[0] = False

            _, finish, n = self._generate(ids, job.params, cancel, piece)
            emit({"role": "assistant", "content": ""} if first[0] else None, None, finish)
            return [], _add(Usage(), len(ids), n)
        choices, usage = [], Usage()
        for i in range(max(1, job.params.n)):
            text, finish, n = self._generate(ids, job.params, cancel, None)
            choices.append(Choice(index=i, message={"role": "assistant", "content": text}, finish_reason=finish))
            usage = _add(usage, len(ids), n)
        return choices, usage

    def complete(self, job: CompletionJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        prompt = one_prompt(self, job)
        ids = self.tok(prompt)["input_ids"]
        params = job.params if job.params.max_tokens else _with_max(job.params, 16)  # OpenAI's default for completions
        choices, usage = [], Usage()

        def piece(t: str) -> None:
            if emit is not None:
                emit(None, t, None)

        on_piece = piece if emit is not None else None
        for i in range(1 if emit is not None else max(1, job.params.n)):
            text, finish, n = self._generate(ids, params, cancel, on_piece)
            if emit is not None:
                emit(None, "", finish)
            choices.append(Choice(index=i, text=(prompt + text) if job.echo else text, finish_reason=finish))
            usage = _add(usage, len(ids), n)
        return ([] if emit is not None else choices), usage

    def _generate(
        self, ids: list[int], params: SamplingParams, cancel: CancelFlag, on_piece: Callable[[str], None] | None
    ) -> tuple[str, FinishReason, int]:
        """Decode token by token with the KV cache: (text, finish_reason, tokens made). Temperature 0 (or below)
        is greedy; stop strings end the text before them."""
        import torch

        limit = int(getattr(self.model.config, "max_position_embeddings", 2048))
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model takes at most {limit}")
        max_new = min(params.max_tokens or self.config.param_int("max_tokens", 256), limit - len(ids))
        temp = 1.0 if params.temperature is None else float(params.temperature)
        gen = torch.Generator(device=self.device)
        if params.seed is not None:
            gen.manual_seed(params.seed)
        made: list[int] = []
        sent = text = ""
        finish: FinishReason = "length"
        past = None
        step_in = torch.tensor([ids], device=self.device)
        with torch.inference_mode():
            for _ in range(max_new):
                if cancel:
                    finish = "cancelled"
                    break
                out = self.model(input_ids=step_in, use_cache=True, **{self._cache_arg: past})
                past = getattr(out, "cache", None) or out.past_key_values
                logits = out.logits[0, -1].float()
                if temp <= 0:
                    token = int(torch.argmax(logits))
                else:
                    probs = torch.softmax(logits / temp, dim=-1)
                    if params.top_p is not None and params.top_p < 1.0:
                        probs = _top_p(torch, probs, params.top_p)
                    token = int(torch.multinomial(probs, 1, generator=gen))
                if token in self.eos:
                    finish = "stop"
                    break
                made.append(token)
                text = self.tok.decode(made, skip_special_tokens=True)
                cut = min((text.find(s) for s in params.stop if s and s in text), default=-1)
                if cut >= 0:
                    text, finish = text[:cut], "stop"
                if on_piece is not None and len(text) > len(sent) and not text.endswith("\ufffd"):
                    on_piece(text[len(sent) :])
                    sent = text
                if finish == "stop":
                    break
                step_in = torch.tensor([[token]], device=self.device)
        if on_piece is not None and len(text) > len(sent):
            on_piece(text[len(sent) :])
        return text, finish, len(made)


def _top_p(torch: Any, probs: Any, top_p: float) -> Any:
    sorted_p, idx = torch.sort(probs, descending=True)
    keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p
    out = torch.zeros_like(probs)
    out[idx[keep]] = sorted_p[keep]
    return out / out.sum()


def _with_max(params: SamplingParams, n: int) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, max_tokens=n)


def _add(usage: Usage, prompt: int, completion: int) -> Usage:
    return Usage(
        prompt_tokens=usage.prompt_tokens + prompt,
        completion_tokens=usage.completion_tokens + completion,
        total_tokens=usage.total_tokens + prompt + completion,
    )
