"""Usage a node reports is billed only within what the request could have used (issue 40 item 2): negative
counts are refused, completions past max_tokens and prompts past the context or the request's size are clamped."""

from __future__ import annotations

import pytest

from coderai.contracts import ChatJob, CompletionJob, ModelConfig, Usage
from coderai.contracts.jobs import SamplingParams
from coderai.contracts.media import EmbedJob
from coderai.gateway.pricing import PROMPT_SLACK, UNBOUNDED_OUTPUT, checked_usage, usage_ceiling


def cfg(**params) -> ModelConfig:
    return ModelConfig(name="m", engine="llama", path="m.gguf", params=params)


def chat(max_tokens: int | None = 8, n: int = 1) -> ChatJob:
    return ChatJob(
        request_id="r",
        model="m",
        messages=[{"role": "user", "content": "hello"}],
        params=SamplingParams(max_tokens=max_tokens, n=n),
    )


def never() -> int:
    raise AssertionError("an honest prompt count needs no size")


def test_an_honest_answer_passes_unchanged_without_measuring_the_request():
    u = Usage(prompt_tokens=12, completion_tokens=8, total_tokens=20, cached_tokens=4, prompt_ms=3.0)
    most = usage_ceiling(cfg(n_ctx=256), chat(), True, never, u.prompt_tokens)
    assert checked_usage(u, *most) == (u, "")


@pytest.mark.parametrize(
    "reported, billed",
    [
        (Usage(prompt_tokens=-150_000_000, completion_tokens=-5, total_tokens=-150_000_005), (0, 0)),
        (Usage(prompt_tokens=10**12, completion_tokens=10**12, total_tokens=2 * 10**12), (256, 8)),
        (Usage(prompt_tokens=20, completion_tokens=9, total_tokens=29, cached_tokens=-3), (20, 8)),
    ],
)
def test_impossible_counts_are_refused_and_said(reported, billed):
    most = usage_ceiling(cfg(n_ctx=256), chat(max_tokens=8), True, lambda: 100, reported.prompt_tokens)
    checked, why = checked_usage(reported, *most)
    assert (checked.prompt_tokens, checked.completion_tokens) == billed and why
    assert checked.total_tokens == sum(billed) and 0 <= checked.cached_tokens <= checked.prompt_tokens


def test_the_ceilings():
    # no context known: a prompt is bounded by the request's bytes (plus a template's slack), an answer without
    # max_tokens by the context, else by UNBOUNDED_OUTPUT; n choices and a list of prompts multiply
    assert usage_ceiling(cfg(), chat(max_tokens=None), True, lambda: 1000, 10**9) == (
        1000 + PROMPT_SLACK,
        UNBOUNDED_OUTPUT,
    )
    assert usage_ceiling(cfg(n_ctx=512), chat(max_tokens=None, n=2), True, never, 5) == (2 * 512, 2 * 512)
    job = CompletionJob(request_id="r", model="m", prompt=["a", "b", "c"], params=SamplingParams(max_tokens=4))
    assert usage_ceiling(cfg(n_ctx=100), job, True, lambda: 10**6, 10**9) == (300, 12)
    # a media op: its size plus UNBOUNDED_OUTPUT (diarization bills seconds, images bill prompts per image)
    embed = EmbedJob(request_id="r", model="m", input=["x"] * 3)
    assert usage_ceiling(cfg(), embed, False, never, 10) == (10, UNBOUNDED_OUTPUT)
    assert usage_ceiling(cfg(), embed, False, lambda: 50, 10**9) == (50 + UNBOUNDED_OUTPUT, UNBOUNDED_OUTPUT)
