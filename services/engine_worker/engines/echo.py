"""A zero-cost test engine: it answers every chat and completion with a fixed reply and does no model work.

It exists so benchmarks and tests can measure the orchestrator alone (gateway, router, bus, worker, metrics)
with the engine taken out of the picture. A worker offers it only when its settings name it
(`CODERAI_WORKER_FAMILIES=echo`); it is never picked up from what is installed.

It lives with the worker's other engines and subclasses their `Engine`, so whatever the worker later asks of
every engine (heartbeat stats, ...) has the base class's default here too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from coderai.contracts import ChatJob, Choice, CompletionJob, ModelConfig, Usage
from coderai.engine_worker.engines.base import Engine

Emit = Callable[[dict[str, Any] | None, str | None, str | None], None]
"""emit(chat_delta, text_piece, finish_reason), as for the real engines"""

DEFAULT_REPLY = "This is the echo test engine answering without any model."


class EchoEngine(Engine):
    """Answers with the words of a fixed reply, one word per token.

    `max_tokens` set: exactly that many tokens (the reply's words repeated as needed), finish reason
    `length`. Unset: the reply once, finish reason `stop`. Model params: `reply` replaces the fixed text;
    `token_delay_s` paces the answer like a model's decoding (that long per token), so a stream lasts long enough
    for a test to cut it mid-way or to keep an engine busy; such jobs then run in threads, side by side.
    """

    family = "echo"
    blocking = False  # nothing to wait for: a thread hop would only add the cost the benchmark measures

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.words: list[str] = []
        self.token_delay_s = float(config.params.get("token_delay_s") or 0.0)
        if self.token_delay_s > 0:  # paced: off the event loop, and not one job after another
            self.blocking, self.max_concurrency = True, 8

    def load(self) -> None:
        text = str(self.config.params.get("reply") or DEFAULT_REPLY)
        self.words = text.split() or ["echo"]

    def close(self) -> None:
        self.words = []

    def _pace(self, tokens: int = 1) -> None:
        if self.token_delay_s:
            time.sleep(self.token_delay_s * tokens)

    def _pieces(self, max_tokens: int | None) -> tuple[list[str], str]:
        words = self.words or DEFAULT_REPLY.split()
        if max_tokens is None:
            n, finish = len(words), "stop"
        else:
            n, finish = max(0, max_tokens), "length"
        return [(w if i == 0 else " " + w) for i, w in ((i, words[i % len(words)]) for i in range(n))], finish

    def chat(self, job: ChatJob, cancel: Any, emit: Emit | None) -> tuple[list[Choice], Usage]:
        pieces, finish = self._pieces(job.params.max_tokens)
        prompt = sum(len(m["content"].split()) for m in job.messages if isinstance(m.get("content"), str))
        if emit is not None:
            emit({"role": "assistant"}, None, None)
            sent = 0
            for piece in pieces:
                if cancel:
                    break
                self._pace()
                emit({"content": piece}, None, None)
                sent += 1
            emit(None, None, finish if sent == len(pieces) else "stop")
            return [], _usage(prompt, sent)
        self._pace(len(pieces))
        text = "".join(pieces)
        n = max(1, job.params.n)
        choices = [Choice(index=i, message={"role": "assistant", "content": text}, finish_reason=finish) for i in range(n)]
        return choices, _usage(prompt, len(pieces) * n)

    def complete(self, job: CompletionJob, cancel: Any, emit: Emit | None) -> tuple[list[Choice], Usage]:
        max_tokens = 16 if job.params.max_tokens is None else job.params.max_tokens  # OpenAI's default
        pieces, finish = self._pieces(max_tokens)
        prompt = len(job.prompt.split())
        if emit is not None:
            sent = 0
            if job.echo:
                emit(None, job.prompt, None)
            for piece in pieces:
                if cancel:
                    break
                self._pace()
                emit(None, piece, None)
                sent += 1
            emit(None, "", finish if sent == len(pieces) else "stop")
            return [], _usage(prompt, sent)
        self._pace(len(pieces))
        text = (job.prompt if job.echo else "") + "".join(pieces)
        n = max(1, job.params.n)
        return [Choice(index=i, text=text, finish_reason=finish) for i in range(n)], _usage(prompt, len(pieces) * n)


def _usage(prompt: int, completion: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
