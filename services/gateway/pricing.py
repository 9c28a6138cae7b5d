"""What a request may cost and what it may be billed: the generous estimate a budget reserves, the ceiling an
engine's reported usage is checked against, and the price of tokens and image or video work. Pure functions of a
model's config and a job (`accounting.py` reserves and charges with them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from coderai.contracts import ImageJob, ModelConfig, Usage
from coderai.gateway.errors import ApiError
from coderai.media_work import OverLimit, Work, work_of


def estimate_cost(cfg: ModelConfig, job: Any) -> float:
    """A generous cost estimate for budget reservations: prompt tokens as half the characters of the request's
    JSON (tokenizers give about 3-4 characters a token, and templates add a few), plus every token it may generate
    (max_tokens, else the whole context); an image or video job adds the whole work it asks for (`media_work`)."""
    if not hasattr(job, "params"):  # a media job: its text (prompt, input, documents), and its pixels x steps
        if isinstance(job, ImageJob):  # the prompt is read once per picture; the pictures sent are no tokens
            prompt = (len(msgspec.json.encode(msgspec.structs.replace(job, image=None, mask=None))) / 2 + 16) * job.n
        else:
            prompt = len(msgspec.json.encode(job)) / 2 + 16
        return prompt * cfg.price_prompt_per_mtok / 1e6 + work_price(cfg, work_of(cfg.params, job))
    text = msgspec.json.encode(job.messages if hasattr(job, "messages") else job.prompt)
    prompt = len(text) / 2 + 16
    n = max(1, job.params.n) * (len(job.prompt) if isinstance(getattr(job, "prompt", None), list) else 1)
    completion = (job.params.max_tokens or cfg.param_int("n_ctx", 4096)) * n
    return (prompt * n * cfg.price_prompt_per_mtok + completion * cfg.price_completion_per_mtok) / 1e6


PROMPT_SLACK = 4096
"""Prompt tokens a request may use beyond one a byte of its job as sent (no tokenizer makes more than one token
a byte; a chat template, tools and images add some)."""
UNBOUNDED_OUTPUT = 131_072
"""Tokens one answer may run to when neither the request (max_tokens) nor the model (n_ctx) bounds it, and what
a media op's usage may reach beyond its request's size."""


def _context(cfg: ModelConfig) -> int:
    try:
        return max(0, cfg.param_int("n_ctx") or 0)
    except (TypeError, ValueError):
        return 0


def usage_ceiling(cfg: ModelConfig, job: Any, llm: bool, size: Callable[[], int], prompt: int) -> tuple[int, int]:
    """The most prompt and completion tokens `job` could have used, whatever its engine says.

    A chat or completion reads at most one token a byte of the job as sent, plus `PROMPT_SLACK`, and no more than
    the model's context per prompt; it writes at most `max_tokens` (after output limits) per choice and prompt,
    else the context, else `UNBOUNDED_OUTPUT`. A media op is bounded by its size plus `UNBOUNDED_OUTPUT`. `size`
    (the job's bytes) is asked only when the reported `prompt` needs it, so an honest answer costs no encoding."""
    params = getattr(job, "params", None)
    n = max(1, getattr(params, "n", None) or getattr(job, "n", 1) or 1)
    if not llm:
        return (prompt if prompt <= UNBOUNDED_OUTPUT else size() + UNBOUNDED_OUTPUT), UNBOUNDED_OUTPUT * n
    prompts = len(job.prompt) if isinstance(getattr(job, "prompt", None), list) else 1
    n_ctx = _context(cfg)
    most = n * (size() + PROMPT_SLACK if prompt > PROMPT_SLACK * n else PROMPT_SLACK)
    if n_ctx:
        most = min(most, n_ctx * prompts * n)
    per_answer = getattr(params, "max_tokens", None) or n_ctx or UNBOUNDED_OUTPUT
    return most, max(0, per_answer) * n * prompts


def checked_usage(usage: Usage, prompt_most: int, completion_most: int) -> tuple[Usage, str]:
    """What may be billed of `usage` an engine reported, and what was wrong with it ("" when nothing): negative
    counts become 0, counts past the request's ceiling (`usage_ceiling`) the ceiling."""
    p = min(max(0, usage.prompt_tokens), prompt_most)
    c = min(max(0, usage.completion_tokens), completion_most)
    cached = min(max(0, usage.cached_tokens), p)
    if (
        (p, c, cached) == (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        and usage.total_tokens == p + c
        and usage.prompt_ms >= 0
        and usage.generate_ms >= 0
    ):
        return usage, ""
    why = []
    if usage.prompt_tokens != p:
        why.append(f"prompt_tokens {usage.prompt_tokens} (at most {prompt_most})")
    if usage.completion_tokens != c:
        why.append(f"completion_tokens {usage.completion_tokens} (at most {completion_most})")
    if usage.cached_tokens != cached:
        why.append(f"cached_tokens {usage.cached_tokens}")
    checked = Usage(
        prompt_tokens=p,
        completion_tokens=c,
        total_tokens=p + c,
        cached_tokens=cached,
        prompt_ms=max(0.0, usage.prompt_ms),
        generate_ms=max(0.0, usage.generate_ms),
    )
    return checked, ", ".join(why)


def price(cfg: ModelConfig, usage: Usage, work: Work | None = None) -> float:
    """What a request costs: its tokens at the model's prices, and the image or video work it was given."""
    return (
        usage.prompt_tokens * cfg.price_prompt_per_mtok + usage.completion_tokens * cfg.price_completion_per_mtok
    ) / 1e6 + work_price(cfg, work)


def work_price(cfg: ModelConfig, work: Work | None) -> float:
    return work.mpixel_steps * cfg.price_per_mpixel_step if work is not None else 0.0


def checked_work(cfg: ModelConfig, job: Any) -> Work | None:
    """The work an image or video job asks for (None for other jobs); past the model's limits (its size, steps,
    n or frames) a 400 naming the param, before any budget is reserved or any engine sees the job."""
    try:
        return work_of(cfg.params, job)
    except OverLimit as exc:
        raise ApiError(400, exc.message, param=exc.param, code="invalid_value") from None
