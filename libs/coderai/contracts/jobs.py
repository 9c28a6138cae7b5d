"""Jobs the gateway sends to one engine, and the frames an engine answers with.

An engine answers every job with a sequence of frames on the caller's reply inbox, numbered from 1:
`Chunk`s (streaming only), `KeepAlive`s while it has nothing to say yet (so the caller can tell a slow
engine from a dead one), and exactly one terminal frame, `Final` or `ErrorReply`.
"""

from __future__ import annotations

from typing import Literal, Union

from coderai.contracts.base import Message, RequestId
from coderai.contracts.errors import ErrorReply
from coderai.contracts.media import Output

EngineOp = Literal["chat", "complete", "embed", "rerank", "image", "speech", "transcribe", "diarize", "ocr", "video"]
"""The ops an engine answers: one `OpSpec` each in `ops.py:OPS`, which has exactly these keys."""
Op = Literal[EngineOp, "train"]
"""Every op a model, a request or a usage record names: an engine's, or `train` (a fine-tuning job's)."""
FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "cancelled"]


class SamplingParams(Message, frozen=True, kw_only=True):
    """Generation knobs common to chat and completions (OpenAI names)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = []
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int = 1
    logprobs: bool = False  # chat: per-token logprobs; completions: with `top_logprobs` alternatives
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias, -100..100


class ChatJob(Message, frozen=True, kw_only=True):
    """One chat completion. `messages`, `tools`, `tool_choice` and `response_format` are OpenAI-shaped JSON."""

    request_id: RequestId
    model: str
    messages: list[dict[str, object]]
    params: SamplingParams = SamplingParams()
    tools: list[dict[str, object]] | None = None
    tool_choice: str | dict[str, object] | None = None  # a mode ("auto", "none", "required") or a named tool
    response_format: dict[str, object] | None = None
    stream: bool = False
    options: dict[str, object] | None = None  # passed to engines that take them: reasoning_effort, chat_template_kwargs
    priority: int = 0  # INTERACTIVE, or BACKGROUND: waits behind the interactive jobs queued for the same engine
    # set by the gateway only: "" when the prompt cache is shared by every key, else an opaque digest of the key; an
    # engine never serves a prompt from a prefix another scope left in its cache
    cache_scope: str = ""
    # set by the gateway only: the affinity keys the router remembers this request's engine under (opaque digests),
    # so that an engine that reports its cache (vLLM's KV events) can say when it no longer holds their prompt
    cache_keys: list[str] = []


class CompletionJob(Message, frozen=True, kw_only=True):
    """One text completion of a raw prompt, or of each of a list of prompts (choice `i * n + j` is the `j`th of
    prompt `i`; only engines with `prompt_lists` take a list)."""

    request_id: RequestId
    model: str
    prompt: str | list[str]
    params: SamplingParams = SamplingParams()
    echo: bool = False
    stream: bool = False
    priority: int = 0  # as ChatJob's
    cache_scope: str = ""  # as ChatJob's
    cache_keys: list[str] = []  # as ChatJob's


INTERACTIVE, BACKGROUND = 0, 1  # a chat or completion job's priority


class CancelJob(Message, frozen=True, kw_only=True):
    """Tells an engine to stop generating for a request whose caller went away."""

    request_id: RequestId


class Usage(Message, frozen=True, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's tokens, those the engine found in its cache (llama-server says)
    # how long the engine took to read the prompt and to generate, where it says (llama-server's `timings`); 0: unknown
    prompt_ms: float = 0.0
    generate_ms: float = 0.0


class Choice(Message, frozen=True, kw_only=True):
    """A finished choice: `message` for chat (OpenAI message JSON), `text` for completions."""

    index: int = 0
    message: dict[str, object] | None = None
    text: str | None = None
    finish_reason: FinishReason | None = None
    logprobs: dict[str, object] | None = None  # OpenAI's choice `logprobs` object, when asked for


class Chunk(Message, frozen=True, kw_only=True, tag="chunk", tag_field="t"):
    """A streamed delta: for chat an OpenAI `delta` object, for completions a text piece, for speech the next
    bytes of audio (`data`), for a long job how far it got (`progress`, 0..1)."""

    seq: int
    index: int = 0
    delta: dict[str, object] | None = None
    text: str | None = None
    finish_reason: FinishReason | None = None
    data: bytes | None = None
    progress: float | None = None
    logprobs: dict[str, object] | None = None  # the logprobs of this delta's tokens, when asked for


class KeepAlive(Message, frozen=True, kw_only=True, tag="keepalive", tag_field="t"):
    """Sent while the engine is busy but has produced nothing new (prefill, queueing)."""

    seq: int
    queued: bool = False  # the job waits for a free slot: nothing of it has started yet


class Final(Message, frozen=True, kw_only=True, tag="final", tag_field="t"):
    """The terminal success frame. Streaming jobs leave `choices` empty: the chunks carried them. Media ops
    (embed, image, speech, ...) put their result in `output`."""

    seq: int
    engine_id: str
    choices: list[Choice] = []
    output: Output | None = None
    usage: Usage = Usage()
    ttft_s: float | None = None


Frame = Union[Chunk, KeepAlive, Final, ErrorReply]
"""Everything an engine may publish to a job's reply inbox."""
