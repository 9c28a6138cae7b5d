"""A zero-cost test engine: it answers every chat and completion with a fixed reply and does no model work.

It exists so benchmarks and tests can measure the orchestrator alone (gateway, router, bus, worker, metrics)
with the engine taken out of the picture. A worker offers it only when its settings name it
(`CODERAI_WORKER_FAMILIES=echo`); it is never picked up from what is installed.

It lives with the worker's other engines and subclasses their `Engine`, so whatever the worker later asks of
every engine (heartbeat stats, ...) has the base class's default here too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from coderai.contracts import ChatJob, Choice, CompletionJob, ModelConfig, Usage
from coderai.contracts.jobs import FinishReason
from coderai.engine_worker.engines.base import CancelFlag, Engine, one_prompt

Emit = Callable[[dict[str, Any] | None, str | None, FinishReason | None], None]
"""emit(chat_delta, text_piece, finish_reason), as for the real engines"""

DEFAULT_REPLY = "This is the echo test engine answering without any model."


class EchoEngine(Engine):
    """Answers with the words of a fixed reply, one word per token.

    `max_tokens` set: exactly that many tokens (the reply's words repeated as needed), finish reason
    `length`. Unset: the reply once, finish reason `stop`. Model params: `reply` replaces the fixed text;
    `token_delay_s` paces the answer like a model's decoding (that long per token), so a stream lasts long enough
    for a test to cut it mid-way or to keep an engine busy; such jobs then run in threads, side by side (`slots`
    of them at once, default 8).

    `tool_calls` ({tool name: arguments}) makes it an agent's scripted model, for the tool round trips of real
    agent programs (no small model that ships offline picks a tool by itself): offered a tool it names, in a turn
    that has no tool result yet, it calls that tool (the first it names that is offered) with those
    arguments, finish reason `tool_calls`; after a tool result it answers `reply` and the result's text; any other
    turn is `reply`. It stops as a model does, whatever `max_tokens` allows (cut to `max_tokens` if fewer).
    """

    family = "echo"
    blocking = False  # nothing to wait for: a thread hop would only add the cost the benchmark measures

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.words: list[str] = []
        self.token_delay_s = config.param_float("token_delay_s", 0.0)
        if self.token_delay_s > 0:  # paced: off the event loop, and not one job after another
            self.blocking, self.max_concurrency = True, config.param_int("slots") or 8

    def load(self) -> None:
        text = str(self.config.params.get("reply") or DEFAULT_REPLY)
        self.words = text.split() or ["echo"]
        script = self.config.params.get("tool_calls")
        self.script: dict[str, Any] | None = dict(script) if isinstance(script, dict) else None

    def close(self) -> None:
        self.words = []

    def _pace(self, tokens: int = 1) -> None:
        if self.token_delay_s:
            time.sleep(self.token_delay_s * tokens)

    def _pieces(self, max_tokens: int | None) -> tuple[list[str], FinishReason]:
        words = self.words or DEFAULT_REPLY.split()
        finish: FinishReason
        if max_tokens is None:
            n, finish = len(words), "stop"
        else:
            n, finish = max(0, max_tokens), "length"
        return [(w if i == 0 else " " + w) for i, w in ((i, words[i % len(words)]) for i in range(n))], finish

    def chat(self, job: ChatJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        prompt = sum(len(c.split()) for m in job.messages if isinstance(c := m.get("content"), str))
        if self.script is not None:
            return self._scripted(job, self.script, prompt, emit)
        pieces, finish = self._pieces(job.params.max_tokens)
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
        if self.token_delay_s:  # a token at a time, as a model generates: a cancel ends it at the next token
            done = 0
            while done < len(pieces) and not cancel:
                self._pace()
                done += 1
            if done < len(pieces):
                pieces, finish = pieces[:done], "stop"
        text = "".join(pieces)
        n = max(1, job.params.n)
        choices = [
            Choice(index=i, message={"role": "assistant", "content": text}, finish_reason=finish) for i in range(n)
        ]
        return choices, _usage(prompt, len(pieces) * n)

    def _scripted(
        self, job: ChatJob, script: dict[str, Any], prompt: int, emit: Emit | None
    ) -> tuple[list[Choice], Usage]:
        """One scripted agent turn (see the class): a tool call, or the reply with the last tool result."""
        offered = [f.get("name") for t in job.tools or [] if isinstance(f := t.get("function"), dict)]
        result = _tool_result(job.messages)
        name = next((n for n in script if n in offered), None)
        if result is None and name is not None and job.tool_choice != "none":
            args = script[name]
            call = {
                "index": 0,
                "id": f"call_{job.request_id[-12:]}",
                "type": "function",
                "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
            if emit is not None:
                emit({"role": "assistant"}, None, None)
                emit({"tool_calls": [call]}, None, None)
                emit(None, None, "tool_calls")
                return [], _usage(prompt, 1)
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [{k: v for k, v in call.items() if k != "index"}],
            }
            return [Choice(index=0, message=message, finish_reason="tool_calls")], _usage(prompt, 1)
        words = list(self.words) + (_text(result.get("content")).split() if result is not None else [])
        cap = job.params.max_tokens
        finish: FinishReason = "length" if cap is not None and cap < len(words) else "stop"
        pieces = [(w if i == 0 else " " + w) for i, w in enumerate(words[:cap] if cap is not None else words)]
        if emit is not None:
            emit({"role": "assistant"}, None, None)
            for piece in pieces:
                emit({"content": piece}, None, None)
            emit(None, None, finish)
            return [], _usage(prompt, len(pieces))
        return (
            [Choice(index=0, message={"role": "assistant", "content": "".join(pieces)}, finish_reason=finish)],
            _usage(prompt, len(pieces)),
        )

    def complete(self, job: CompletionJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        max_tokens = 16 if job.params.max_tokens is None else job.params.max_tokens  # OpenAI's default
        pieces, finish = self._pieces(max_tokens)
        text_in = one_prompt(self, job)
        prompt = len(text_in.split())
        if emit is not None:
            sent = 0
            if job.echo:
                emit(None, text_in, None)
            for piece in pieces:
                if cancel:
                    break
                self._pace()
                emit(None, piece, None)
                sent += 1
            emit(None, "", finish if sent == len(pieces) else "stop")
            return [], _usage(prompt, sent)
        self._pace(len(pieces))
        text = (text_in if job.echo else "") + "".join(pieces)
        n = max(1, job.params.n)
        return [Choice(index=i, text=text, finish_reason=finish) for i in range(n)], _usage(prompt, len(pieces) * n)


def _tool_result(messages: list[dict[str, object]]) -> dict[str, object] | None:
    """The last tool result of the turn the user began last, if any: a user message that comes straight after a
    tool result (an agent's reminder beside the result, as Claude Code sends) does not begin a turn."""
    for i in range(len(messages) - 1, -1, -1):
        role = messages[i].get("role")
        if role == "tool":
            return messages[i]
        if role == "user" and (i == 0 or messages[i - 1].get("role") != "tool"):
            return None
    return None


def _text(content: object) -> str:
    """A message's text: its string, or its text parts joined."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return " ".join(str(p.get("text", "")) for p in parts if isinstance(p, dict) and p.get("type") == "text")


def _usage(prompt: int, completion: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
