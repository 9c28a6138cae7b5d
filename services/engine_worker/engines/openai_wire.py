"""The OpenAI wire format, from the worker's side: request bodies from our jobs, answers and SSE events back as
choices and usage, a server's error answers as the worker's errors. Pure: no I/O, no process (see openai_client
for the HTTP, child_server for a server this worker runs itself)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from coderai.contracts import ChatJob, Choice, CompletionJob, SamplingParams, Usage
from coderai.engine_worker.engines.base import BadInput, CancelFlag

FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")


def _sampling(p: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if v is not None:
            out[name] = v
    if p.stop:
        out["stop"] = list(p.stop)
    if p.n != 1:
        out["n"] = p.n
    if p.logit_bias:
        out["logit_bias"] = p.logit_bias
    return out


def chat_request(model: str, job: ChatJob, stream: bool) -> dict[str, Any]:
    """The OpenAI `/v1/chat/completions` body for a chat job (its `options` too: reasoning_effort, ...)."""
    extras = {
        "tools": job.tools or None,
        "tool_choice": job.tool_choice,
        "response_format": job.response_format or None,
        **{k: v for k, v in (job.options or {}).items() if k != "lora_scale"},  # llama-server's own: its engine
    }
    if job.params.logprobs:
        extras["logprobs"] = True
        extras["top_logprobs"] = job.params.top_logprobs
    return {
        "model": model,
        "messages": job.messages,
        **_sampling(job.params),
        **{k: v for k, v in extras.items() if v is not None},
    }


def completion_request(model: str, job: CompletionJob, stream: bool) -> dict[str, Any]:
    """The OpenAI `/v1/completions` body for a completion job."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": job.prompt,
        "max_tokens": 16,  # OpenAI's default
        **_sampling(job.params),
    }
    if job.params.logprobs:
        body["logprobs"] = job.params.top_logprobs or 0
    return {**body, "echo": True} if job.echo else body


def sse_events(lines: Iterator[str], cancel: CancelFlag, label: str = "the server") -> Iterator[dict[str, Any]]:
    """The JSON payloads of an SSE stream's `data:` lines, until `[DONE]` or until `cancel` is set."""
    for line in lines:
        if cancel:
            return
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if not isinstance(event, dict):  # llama-server opens a stream over a list of prompts with `null`
            continue
        if "error" in event:  # a failure after the stream began arrives as an event, not a status
            raise_error(event, 500, label)
        yield event
    if not cancel:  # the connection ended without the server's last word: it died or dropped us mid-answer
        raise RuntimeError(f"{label} ended the stream before [DONE]")


def raise_error(body: Any, status: int, label: str = "the server") -> None:
    """A server's error answer as the worker's errors: a 400 is the client's (BadInput, naming its param)."""
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else (body if isinstance(body, dict) else {})
    message = str(err.get("message") or body)
    code = err.get("code") or status
    # llama-server answers a conversation its chat template cannot take (a message, a tool call) with a 500
    # "Failed to parse messages": the client's input, not the server's failure
    unparsed = message.startswith("Failed to parse messages")
    if code == 400 or status == 400 or unparsed:
        raise BadInput(f"{label}: {message}", err.get("param") or ("messages" if unparsed else None))
    raise RuntimeError(f"{label} answered {code}: {message}")


def error_body(data: bytes) -> Any:
    """An error answer's body: its JSON, else its first bytes as the message."""
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError:
        return {"message": data[:2000].decode("utf-8", "replace")}


def finish_reason(reason: str | None) -> Any:
    """A server's finish reason as ours: one OpenAI names, else `stop`."""
    return reason if reason in FINISH_REASONS else "stop"


def choice_logprobs(choice: dict[str, Any]) -> dict | None:
    """A choice's logprobs as OpenAI's schema has them: a chat choice's always name `refusal` (null here), which
    llama-server leaves out."""
    lp = choice.get("logprobs") or None
    if lp is not None and "content" in lp:
        lp.setdefault("refusal", None)
    return lp


def _joined_logprobs(have: dict | None, more: dict) -> dict:
    """Two pieces' logprobs as one: every list in them (chat's `content`, completions' `tokens`, ...) joined."""
    if have is None:
        return dict(more)
    return {k: (have.get(k) or []) + v if isinstance(v, list) else v for k, v in more.items()}


class Assembly:
    """Whole choices from a stream's pieces: content, reasoning and tool calls (by their index) put together."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.parts: dict[int, dict[str, Any]] = {}

    def add(
        self, delta: dict | None, text: str | None, finish: str | None, logprobs: dict | None = None, index: int = 0
    ) -> None:
        c = self.parts.setdefault(index, {"message": {}, "text": "", "finish": None, "logprobs": None})
        if text:
            c["text"] += text
        msg = c["message"]
        for key, value in (delta or {}).items():
            if key == "tool_calls":
                calls = msg.setdefault("tool_calls", [])
                for t in value:
                    i = t.get("index", len(calls))
                    while len(calls) <= i:
                        calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                    if t.get("id"):
                        calls[i]["id"] = t["id"]
                    fn = t.get("function") or {}
                    calls[i]["function"]["name"] += fn.get("name") or ""
                    calls[i]["function"]["arguments"] += fn.get("arguments") or ""
            elif isinstance(value, str) and key != "role":
                msg[key] = msg.get(key, "") + value
        if logprobs:
            c["logprobs"] = _joined_logprobs(c["logprobs"], logprobs)
        if finish:
            c["finish"] = finish

    def choices(self) -> list[Choice]:
        out = []
        for i, c in sorted(self.parts.items()):
            if self.chat:
                out.append(
                    Choice(
                        index=i,
                        message={"role": "assistant", "content": None, **c["message"]},
                        finish_reason=c["finish"] or "stop",
                        logprobs=c["logprobs"],
                    )
                )
            else:
                out.append(Choice(index=i, text=c["text"], finish_reason=c["finish"] or "stop", logprobs=c["logprobs"]))
        return out


def merged_usage(usages: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One usage of a stream whose server counted each choice apart: every completion token, and each prompt
    once (its `n` choices all counted it)."""
    if len(usages) == 1:
        return usages[0]

    def total(name: str, of: Callable[[dict], Any] = lambda u: u) -> int:
        return sum(int((of(u) or {}).get(name) or 0) for u in usages)

    return {
        "prompt_tokens": total("prompt_tokens") // n,
        "completion_tokens": total("completion_tokens"),
        "prompt_tokens_details": {
            "cached_tokens": total("cached_tokens", lambda u: u.get("prompt_tokens_details")) // n
        },
    }


def usage_of(u: dict[str, Any] | None, timings: Any = None) -> Usage:
    """The server's usage; with llama-server's `timings`, how long it read the prompt and generated."""
    if not u:
        return Usage()
    p, c = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    details = u.get("prompt_tokens_details")
    cached = int((details.get("cached_tokens") if isinstance(details, dict) else 0) or 0)
    t = timings if isinstance(timings, dict) else {}
    return Usage(
        prompt_tokens=p,
        completion_tokens=c,
        total_tokens=p + c,
        cached_tokens=min(max(cached, 0), p),
        prompt_ms=_ms(t.get("prompt_ms")),
        generate_ms=_ms(t.get("predicted_ms")),
    )


def _ms(value: Any) -> float:
    """A duration the server reported, in ms: a finite, non-negative number, else 0 (unknown)."""
    return float(value) if isinstance(value, (int, float)) and 0 <= value < 1e12 else 0.0
