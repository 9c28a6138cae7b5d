"""llama.cpp through llama-cpp-python: chat (tools, JSON mode) and completions, streamed or not.

One `Llama` object is not thread-safe, so the worker runs all of an engine's jobs on one thread, in arrival
order; llama.cpp then reuses the longest common token prefix with the previous job's KV cache by itself.
Generation checks the request's cancel flag on every token through a logits processor (the one per-token hook
`create_chat_completion` offers). It runs as a C callback, where an exception would be swallowed, so a cancelled
request is stopped by forcing the end-of-sequence token instead. The same hook counts tokens for `usage` when
streaming (llama-cpp-python reports usage only for non-streamed answers).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from coderai.contracts import ChatJob, Choice, CompletionJob, ModelConfig, SamplingParams, Usage
from coderai.engine_worker.engines.base import CancelFlag, Engine, EngineLoadError

Emit = Callable[[dict[str, Any] | None, str | None, str | None], None]
"""emit(chat_delta, text_piece, finish_reason)"""

DEFAULTS: dict[str, Any] = {"n_ctx": 2048, "n_batch": 512, "verbose": False}


class _Meter:
    """Logits processor: forces end-of-sequence once cancelled; counts prompt and generated tokens."""

    def __init__(self, cancel: CancelFlag, eos: int) -> None:
        self.cancel = cancel
        self.eos = eos
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if self.cancel:
            scores[:] = -float("inf")
            scores[self.eos] = 0.0
            return scores
        if self.completion_tokens == 0:
            self.prompt_tokens = len(input_ids)
        self.completion_tokens += 1
        return scores

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens)


def _sampling(p: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if p.max_tokens is not None:
        out["max_tokens"] = p.max_tokens
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if v is not None:
            out[name] = v
    if p.stop:
        out["stop"] = list(p.stop)
    return out


class LlamaEngine(Engine):
    family = "llama"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.llm: Any = None

    def load(self) -> None:
        try:
            from llama_cpp import Llama, LogitsProcessorList
        except ImportError as exc:
            raise EngineLoadError("llama-cpp-python is not installed: pip install 'coderai[llama]'") from exc
        self._processors = LogitsProcessorList
        path = os.path.expanduser(self.config.path)
        if not os.path.isfile(path):
            raise EngineLoadError(f"model file not found: {path}")
        kwargs = {**DEFAULTS, "n_threads": max(1, os.cpu_count() or 1), **self.config.params}
        try:
            self.llm = Llama(model_path=path, **kwargs)
        except (ValueError, RuntimeError, TypeError) as exc:
            raise EngineLoadError(f"llama.cpp could not load {path}: {exc}") from exc

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None

    def _meter(self, cancel: CancelFlag) -> _Meter:
        return _Meter(cancel, self.llm.token_eos())

    def cache_tokens(self) -> int:
        """Tokens currently held in the KV cache (what a repeated prefix can reuse)."""
        return int(getattr(self.llm, "n_tokens", 0) or 0)

    # --- chat -------------------------------------------------------------------------------------

    def chat(self, job: ChatJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        kwargs = _sampling(job.params)
        if job.tools:
            kwargs["tools"] = job.tools
        if job.tool_choice is not None:
            kwargs["tool_choice"] = job.tool_choice
        if job.response_format:
            kwargs["response_format"] = _response_format(job.response_format)

        def run(meter: _Meter, stream: bool) -> Any:
            return self.llm.create_chat_completion(
                messages=job.messages, stream=stream, logits_processor=self._processors([meter]), **kwargs
            )

        if emit is not None:
            meter = self._meter(cancel)
            for chunk in run(meter, True):
                if cancel:
                    break  # closing the generator ends llama.cpp's decode loop
                c = chunk["choices"][0]
                delta = {k: v for k, v in (c.get("delta") or {}).items() if v is not None}
                finish = c.get("finish_reason")
                if delta or finish:
                    emit(delta or None, None, _finish(finish) if finish else None)
            return [], meter.usage()

        choices: list[Choice] = []
        usage = Usage()
        for i in range(max(1, job.params.n)):
            r = run(self._meter(cancel), False)
            c = r["choices"][0]
            msg = {k: v for k, v in c["message"].items() if v is not None}
            choices.append(Choice(index=i, message=msg, finish_reason=_finish(c.get("finish_reason"))))
            usage = _add(usage, r.get("usage"))
        return choices, usage

    # --- completions ------------------------------------------------------------------------------

    def complete(self, job: CompletionJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        kwargs = _sampling(job.params)
        kwargs.setdefault("max_tokens", 16)  # the OpenAI default for completions

        def run(meter: _Meter, stream: bool) -> Any:
            return self.llm.create_completion(
                job.prompt, stream=stream, echo=job.echo, logits_processor=self._processors([meter]), **kwargs
            )

        if emit is not None:
            meter = self._meter(cancel)
            for chunk in run(meter, True):
                if cancel:
                    break
                c = chunk["choices"][0]
                finish = c.get("finish_reason")
                if c.get("text") or finish:
                    emit(None, c.get("text") or "", _finish(finish) if finish else None)
            return [], meter.usage()

        choices: list[Choice] = []
        usage = Usage()
        for i in range(max(1, job.params.n)):
            r = run(self._meter(cancel), False)
            c = r["choices"][0]
            choices.append(Choice(index=i, text=c["text"], finish_reason=_finish(c.get("finish_reason"))))
            usage = _add(usage, r.get("usage"))
        return choices, usage


def _response_format(rf: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's `json_schema` format becomes llama-cpp-python's `json_object` with a schema (grammar-enforced)."""
    if rf.get("type") == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema")
        return {"type": "json_object", "schema": schema} if schema else {"type": "json_object"}
    return rf


def _finish(reason: str | None) -> Any:
    return reason if reason in ("stop", "length", "tool_calls", "content_filter") else "stop"


def _add(u: Usage, r: dict[str, int] | None) -> Usage:
    if not r:
        return u
    p = u.prompt_tokens + r.get("prompt_tokens", 0)
    c = u.completion_tokens + r.get("completion_tokens", 0)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)
