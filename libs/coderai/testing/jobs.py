"""Jobs as engine tests send them: a one-message chat and a completion, greedy and short unless told."""

from __future__ import annotations

from typing import Any

from coderai.contracts import ChatJob, CompletionJob, SamplingParams
from coderai.contracts.base import RequestId


def chat(content: str = "hi", model: str = "tiny", **kw: Any) -> ChatJob:
    """A chat of one user message; `params` (a dict) over 8 tokens at temperature 0; other keywords are ChatJob's."""
    params = SamplingParams(**{"max_tokens": 8, "temperature": 0.0, **kw.pop("params", {})})
    return ChatJob(
        request_id=RequestId("r"), model=model, messages=[{"role": "user", "content": content}], params=params, **kw
    )


def completion(prompt: str = "def f():", model: str = "tiny", **kw: Any) -> CompletionJob:
    """A completion of `prompt`; `params` (a dict) over 5 tokens at temperature 0; other keywords (`request_id`
    among them) are CompletionJob's."""
    params = SamplingParams(**{"max_tokens": 5, "temperature": 0.0, **kw.pop("params", {})})
    return CompletionJob(**{"request_id": RequestId("r"), **kw}, model=model, prompt=prompt, params=params)
