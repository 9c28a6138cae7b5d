"""llama.cpp through llama-cpp-python: chat (tools, JSON mode) and completions, streamed or not.

One `Llama` object is not thread-safe, so the worker runs all of an engine's jobs on one thread, in arrival
order. Prefix reuse: llama.cpp keeps the previous job's KV and recomputes only what differs; on top of that a
RAM prompt cache (`prompt_cache_mb` in the model's params, default 256) keeps the KV state of recent prompts, so
several interleaved conversations each find their own prefix warm. The prompt tokens actually computed are read
from llama.cpp's own counters, so `cached_tokens` is what the cache really saved.
Tenants (ChatJob.cache_scope, ModelConfig.share_cache): the RAM cache is one pool for every key, so a model whose
cache is not shared loads without it, and it is dropped when the first scoped job comes; the KV the context holds
is reused only by a job of the scope that left it (`_enter_scope` resets it otherwise).
Generation checks the request's cancel flag on every token through a logits processor (the one per-token hook
`create_chat_completion` offers). It runs as a C callback, where an exception would be swallowed, so a cancelled
request is stopped by forcing the end-of-sequence token instead. The same hook counts tokens for `usage` when
streaming (llama-cpp-python reports usage only for non-streamed answers).

Embedding models (params `embedding = true`, or a model whose ops include `embed`) load with `embedding=True`
and a pooling that gives one vector per text: params `pooling` (mean, cls, last), else the GGUF's own, else mean
(a llama-type GGUF declares none, and llama.cpp would answer one vector per token). They answer `embed` like the
sentence-transformers engine: normalised float32 vectors, `dimensions` truncating and re-normalising.

A copy the scheduler pinned to GPUs (`devices`) offloads every layer there (`gpu_params`); without devices it runs
as its params say (llama-cpp-python's default: the CPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from coderai.contracts import ChatJob, Choice, CompletionJob, ModelConfig, SamplingParams, Usage
from coderai.contracts.media import EmbedJob, EmbedResult
from coderai.engine_worker.engines.base import BadInput, CancelFlag, Engine, EngineLoadError, refuse_media
from coderai.engine_worker.engines.embed import check_dimensions, check_texts, embed_result
from coderai.engine_worker.node import GpuProbe

Emit = Callable[[dict[str, Any] | None, str | None, str | None], None]
"""emit(chat_delta, text_piece, finish_reason)"""

DEFAULTS: dict[str, Any] = {"n_ctx": 2048, "n_batch": 512, "verbose": False}
DEFAULT_PROMPT_CACHE_MB = 256
EMBED_CHUNK = 16  # texts per llama.cpp call: the cancel flag is checked between chunks
POOLINGS = ("mean", "cls", "last")
LLAMA_SPLIT_MODE_NONE, LLAMA_SPLIT_MODE_LAYER = 0, 1


def gpu_params(devices: list[int], params: dict[str, Any], free: list[int]) -> dict[str, Any]:
    """llama.cpp's placement on the GPUs the scheduler gave this copy: every layer offloaded (unless the params say
    how many); one card alone, or several sharing the layers by their `free` memory (llama.cpp's own rule, kept
    to these cards). What the params set themselves wins; no devices: nothing, so a CPU run is unchanged."""
    if not devices:
        return {}
    out: dict[str, Any] = {"n_gpu_layers": -1, "main_gpu": devices[0], "split_mode": LLAMA_SPLIT_MODE_NONE}
    if len(devices) > 1:
        out["split_mode"] = LLAMA_SPLIT_MODE_LAYER
        out["tensor_split"] = [
            float(free[i] if i < len(free) else 1) if i in devices else 0.0 for i in range(max(devices) + 1)
        ]
    return {k: v for k, v in out.items() if k not in params}


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
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )


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
    if p.logit_bias:
        out["logit_bias"] = {int(k): v for k, v in p.logit_bias.items()}
    return out


def openai_delta(delta: dict, announced: set[int]) -> dict:
    """A streamed chat delta as OpenAI sends it. llama-cpp-python repeats a tool call's `id`, `type` and
    `function.name` in every chunk, next to a legacy `function_call`; clients concatenate what they get (the
    SDK's stream helper and LangChain made `get_weatherget_weather...`), so those go only in a call's first
    delta (`announced` holds the indices already sent) and `function_call` is dropped."""
    out = {k: v for k, v in delta.items() if v is not None and k != "function_call"}
    calls = out.get("tool_calls")
    if calls:
        tidy = []
        for pos, call in enumerate(calls):
            index = call.get("index", pos)
            call = {**call, "index": index}
            if index in announced:
                call.pop("id", None)
                call.pop("type", None)
                call["function"] = {k: v for k, v in (call.get("function") or {}).items() if k != "name"}
            else:
                announced.add(index)
            tidy.append(call)
        out["tool_calls"] = tidy
    return out


class LlamaEngine(Engine):
    family = "llama"
    logit_bias = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.llm: Any = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prefix_hits = 0
        self.embedding = False
        self._scoped = config.share_cache is False  # a job's cache scope is honoured (from its first scoped job)
        self._held = ""  # the scope of the prompt the context holds

    def load(self) -> None:
        try:
            from llama_cpp import Llama, LogitsProcessorList
        except ImportError as exc:
            raise EngineLoadError("llama-cpp-python is not installed: pip install 'coderai[llama]'") from exc
        self._processors = LogitsProcessorList
        path = os.path.expanduser(self.config.path)
        if not os.path.isfile(path):
            raise EngineLoadError(f"model file not found: {path}")
        params = dict(self.config.params)
        params.pop("prompt_cache_mb", None)
        cache_mb = self.config.param_float("prompt_cache_mb", DEFAULT_PROMPT_CACHE_MB)
        if self.config.share_cache is False:
            cache_mb = 0  # one pool for every key: it would hand one key's saved prompt to another
        embedding = params.pop("embedding", None)
        self.embedding = bool(embedding) if embedding is not None else "embed" in self.config.serves()
        pooling = params.pop("pooling", params.pop("pooling_type", None))
        if pooling is not None and not isinstance(pooling, (str, int)):
            raise EngineLoadError(
                f"pooling {pooling!r} is neither a name ({', '.join(POOLINGS)}) nor llama.cpp's number"
            )
        kwargs = {**DEFAULTS, "n_threads": max(1, os.cpu_count() or 1), **params}
        free = [f for _, f in GpuProbe().devices()] if len(self.config.devices) > 1 else []
        kwargs.update(gpu_params(self.config.devices, params, free))
        if self.embedding:
            kwargs.update(embedding=True, pooling_type=_pooling(Llama, path, pooling))
            # llama-cpp-python cuts a text at n_batch tokens, and encoder models need a whole text in one
            # micro-batch: let one text fill the context unless the models file says otherwise
            kwargs["n_batch"] = params.get("n_batch", kwargs["n_ctx"])
            kwargs.setdefault("n_ubatch", kwargs["n_batch"])
            cache_mb = 0  # nothing to reuse: every text is embedded from scratch
        # llama-cpp-python gives prompt processing every core unless told; with two engines on a box that
        # oversubscribes the CPU and ggml's spinning barriers make prefill 10x slower: follow n_threads
        kwargs.setdefault("n_threads_batch", kwargs["n_threads"])
        try:
            self.llm = Llama(model_path=path, **kwargs)
        except (ValueError, RuntimeError, TypeError) as exc:
            raise EngineLoadError(f"llama.cpp could not load {path}: {exc}") from exc
        if cache_mb > 0:
            self.llm.set_cache(_prefix_cache(int(cache_mb * (1 << 20))))
        import llama_cpp

        self._perf = lambda: llama_cpp.llama_perf_context(self.llm._ctx.ctx).n_p_eval

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None

    # --- embeddings -----------------------------------------------------------------------------

    def embed(self, job: EmbedJob, cancel: CancelFlag, emit: Any) -> tuple[EmbedResult, Usage]:
        """One normalised vector per input text, in order; usage counts the tokens llama.cpp read."""
        if not self.embedding:
            raise BadInput(
                f"model {job.model!r} is not loaded for embeddings (its params need embedding = true)", param="model"
            )
        check_texts(job.input)
        dim = check_dimensions(job.dimensions, self.llm.n_embd())
        vectors: list[list[float]] = []
        tokens = 0
        for start in range(0, len(job.input), EMBED_CHUNK):
            if cancel:
                break  # nobody reads the answer any more
            got, n = self.llm.embed(list(job.input[start : start + EMBED_CHUNK]), return_count=True)
            vectors.extend(got)
            tokens += n
        if not vectors:
            return EmbedResult(vectors=b"", count=0, dim=dim), Usage()
        return embed_result(vectors, job.dimensions), Usage(prompt_tokens=tokens, total_tokens=tokens)

    def _meter(self, cancel: CancelFlag) -> _Meter:
        return _Meter(cancel, self.llm.token_eos())

    def stats(self) -> dict[str, int]:
        """Prompt-cache counters for the heartbeat (read from the event loop while the engine thread runs)."""
        cache = getattr(self.llm, "cache", None)
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefix_hits": self.prefix_hits,
            "cache_bytes": int(cache.cache_size) if cache is not None else 0,
        }

    def _account(self, prompt_tokens: int, evaluated_before: int) -> None:
        """Count what this job's prompt cost: tokens it had minus tokens llama.cpp computed."""
        computed = self._perf() - evaluated_before
        reused = max(0, prompt_tokens - computed)
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += reused
        if reused > 0:
            self.prefix_hits += 1

    # --- chat -------------------------------------------------------------------------------------

    def media_takes(self) -> frozenset[str]:
        return frozenset()  # llama-cpp-python's handlers here read text only

    def _enter_scope(self, scope: str) -> None:
        """Before a job of `scope` ("" shared): nothing another scope left in the context or the RAM cache is
        reused (`reset` makes llama-cpp-python recompute the whole prompt)."""
        if not scope and not self._scoped:
            return  # no scoped job came yet: prefix reuse as ever
        if not self._scoped:
            self._scoped = True
            self.llm.set_cache(None)
            self._held = "\x00unknown"
        if scope != self._held:
            self.llm.reset()
        self._held = scope

    def chat(self, job: ChatJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        refuse_media(job.messages, self.config.name)
        self._enter_scope(job.cache_scope)
        if job.params.logprobs:
            raise BadInput(
                f"model '{self.config.name}' runs on the in-process llama engine, which gives no logprobs; "
                "the llama-server engine does",
                "logprobs",
            )
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

        announced: set[int] = set()  # tool calls whose id and name were sent

        def piece(c: dict) -> tuple[dict | None, str | None]:
            return openai_delta(c.get("delta") or {}, announced) or None, None

        def whole(i: int, c: dict) -> Choice:
            msg = {k: v for k, v in c["message"].items() if v is not None and k != "function_call"}
            return Choice(index=i, message=msg, finish_reason=_finish(c.get("finish_reason")))

        return self._generate(run, job.params.n, cancel, emit, piece, whole)

    # --- completions ------------------------------------------------------------------------------

    def complete(self, job: CompletionJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        if job.params.logprobs:
            raise BadInput(
                f"model '{self.config.name}' runs on the in-process llama engine, which gives no logprobs; "
                "the llama-server engine does",
                "logprobs",
            )
        self._enter_scope(job.cache_scope)
        kwargs = _sampling(job.params)
        kwargs.setdefault("max_tokens", 16)  # the OpenAI default for completions

        def run(meter: _Meter, stream: bool) -> Any:
            return self.llm.create_completion(
                job.prompt, stream=stream, echo=job.echo, logits_processor=self._processors([meter]), **kwargs
            )

        def piece(c: dict) -> tuple[dict | None, str | None]:
            return None, c.get("text") or ""

        def whole(i: int, c: dict) -> Choice:
            return Choice(index=i, text=c["text"], finish_reason=_finish(c.get("finish_reason")))

        return self._generate(run, job.params.n, cancel, emit, piece, whole)

    # --- shared -----------------------------------------------------------------------------------

    def _generate(
        self,
        run: Callable,
        n: int,
        cancel: CancelFlag,
        emit: Emit | None,
        piece: Callable[[dict], tuple[dict | None, str | None]],
        whole: Callable[[int, dict], Choice],
    ) -> tuple[list[Choice], Usage]:
        """Streamed: emit each piece, stop early on cancel, count usage with the meter. Whole: `n` answers
        (llama.cpp makes one per call), usage as llama-cpp-python reports it."""
        before = self._perf()
        if emit is not None:
            meter = self._meter(cancel)
            for chunk in run(meter, True):
                if cancel:
                    break  # closing the generator ends llama.cpp's decode loop
                c = chunk["choices"][0]
                delta, text = piece(c)
                finish = c.get("finish_reason")
                if delta or text or finish:
                    emit(delta, text, _finish(finish) if finish else None)
            self._account(meter.prompt_tokens, before)
            return [], meter.usage()
        choices: list[Choice] = []
        usage = Usage()
        for i in range(max(1, n)):
            r = run(self._meter(cancel), False)
            choices.append(whole(i, r["choices"][0]))
            usage = _add(usage, r.get("usage"))
            self._account(r["usage"]["prompt_tokens"], before)
            before = self._perf()
        return choices, usage


def _pooling(llama_cls: Any, path: str, pooling: str | int | None) -> int:
    """llama.cpp's pooling type for an embedding model: the one asked for, else the GGUF's own, else mean."""
    import llama_cpp

    by_type = {getattr(llama_cpp, f"LLAMA_POOLING_TYPE_{p.upper()}"): p for p in POOLINGS}
    if pooling is None:
        # the GGUF may name its pooling (BERT-style models do, often CLS); a vocab-only open reads it in ms
        try:
            peek = llama_cls(model_path=path, vocab_only=True, verbose=False)
        except (ValueError, RuntimeError) as exc:
            raise EngineLoadError(f"llama.cpp could not read {path}: {exc}") from exc
        try:
            arch = peek.metadata.get("general.architecture", "")
            pooling = by_type.get(int(peek.metadata.get(f"{arch}.pooling_type", -1)), "mean")
        finally:
            peek.close()
    name = by_type.get(pooling, pooling) if isinstance(pooling, int) else str(pooling).lower()
    if name not in POOLINGS:
        raise EngineLoadError(f"pooling {pooling!r} gives no single vector per text: use one of {', '.join(POOLINGS)}")
    return getattr(llama_cpp, f"LLAMA_POOLING_TYPE_{name.upper()}")


SUPERSEDED_TAIL = 64


def _prefix_cache(capacity_bytes: int) -> Any:
    """llama-cpp-python's RAM prompt cache, keeping one state per conversation instead of one per turn.

    Each answer saves a state keyed by prompt + answer tokens. The next turn's state shares all of the previous
    one but its last few tokens (the answer, re-tokenized from text, then the turn's end marker), and serves any
    request the old one could: llama.cpp re-evaluates from the longest common prefix. So a new state drops older
    states it covers up to their last `SUPERSEDED_TAIL` tokens; without that, eight conversations need sixteen
    states, and a budget sized for eight thrashes.
    """
    from llama_cpp import Llama, LlamaRAMCache

    class PrefixRAMCache(LlamaRAMCache):
        def __setitem__(self, key: Any, value: Any) -> None:
            key = tuple(key)
            for old in [k for k in self.cache_state if k != key]:
                shared = Llama.longest_token_prefix(old, key)
                if shared >= len(old) - SUPERSEDED_TAIL and shared * 2 > len(old):
                    del self.cache_state[old]
            super().__setitem__(key, value)

    return PrefixRAMCache(capacity_bytes=capacity_bytes)


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
