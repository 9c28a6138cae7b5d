"""Ollama's API (`/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`, `/api/version`; the model routes,
`/api/tags`, `/api/show`, `/api/pull`, `/api/create`, ..., are `ollama_models`'), so the `ollama` client, Open
WebUI's Ollama connection and every Ollama integration work against coderai: the same pipeline as the OpenAI
endpoints, answers streamed as NDJSON (Ollama's default) or whole. The key goes in the `Authorization` header, as the clients send it when given one."""

from __future__ import annotations

import json
import re
import time
from functools import partial
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.response import Stream

from coderai.contracts import ChatJob, Chunk, CompletionJob, EmbedJob, Final, RequestId, SamplingParams
from coderai.gateway.errors import ApiError
from coderai.gateway.http import json_response, new_request_id, read_json
from coderai.gateway.openai import formats
from coderai.gateway.openai.chat_types import ROLES
from coderai.gateway.ollama_models import FOREVER, NDJSON, OllamaModelRoutes, model_json, running_json  # noqa: F401 - FOREVER, model_json, running_json: imported from here too
from coderai.gateway.ollama_models import line as _line
from coderai.gateway.ollama_models import now as _now
from coderai.gateway.pipeline import Call, answer, open_stream

VERSION = "0.12.0"  # the Ollama API version these routes follow (clients gate features on it)


class ChatRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] | None = None
    format: Any = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: Any = None
    think: Any = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    model: str
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    format: Any = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: Any = None


class EmbedRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[str]
    truncate: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: Any = None
    dimensions: int | None = None


class EmbeddingsRequest(msgspec.Struct, kw_only=True):  # the older /api/embeddings
    model: str
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: Any = None


def params(options: dict[str, Any] | None) -> SamplingParams:
    """Ollama's `options` in the OpenAI names the engines take; options without an equivalent are ignored."""
    o = options or {}
    stop = o.get("stop") or []
    try:
        return SamplingParams(
            max_tokens=o.get("num_predict") if (o.get("num_predict") or 0) > 0 else None,
            temperature=o.get("temperature"), top_p=o.get("top_p"), seed=o.get("seed"),
            stop=[stop] if isinstance(stop, str) else list(stop),
            presence_penalty=o.get("presence_penalty"), frequency_penalty=o.get("frequency_penalty"))
    except (TypeError, msgspec.ValidationError) as exc:
        raise ApiError(400, f"Invalid options: {exc}", param="options", code="invalid_request") from None


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def keep_alive(value: Any) -> float | None:
    """Ollama's `keep_alive` in seconds: a number of seconds or a Go duration ("5m", "1h30m", "-1s"); negative
    keeps the model loaded for good, 0 unloads it once idle. None when the request sets none."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = value.strip() if isinstance(value, str) else ""
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
    try:
        return sign * float(body)
    except ValueError:
        pass
    parts = _DURATION.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise ApiError(400, f"keep_alive must be seconds or a duration such as \"5m\", not {value!r}.",
                       param="keep_alive", code="invalid_value")
    return sign * sum(float(n) * _UNIT_S[u] for n, u in parts)


def response_format(fmt: Any) -> dict[str, Any] | None:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):  # a JSON schema
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt}}
    raise ApiError(400, "format is \"json\" or a JSON schema.", param="format", code="invalid_request")


def openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama messages as OpenAI's: `images` (base64) become image parts, tool calls' arguments JSON text."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, "Each message is an object.", param=f"messages[{i}]", code="invalid_request")
        role, content = m.get("role", "user"), m.get("content") or ""
        if not isinstance(role, str) or role not in ROLES:  # the chat template would fail on it: a 502
            raise ApiError(400, f"messages[{i}].role must be one of {sorted(ROLES)}.", param=f"messages[{i}].role",
                           code="invalid_request")
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string.", param=f"messages[{i}].content",
                           code="invalid_request")
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.get("images"):
            images = m["images"]
            if not isinstance(images, list) or not all(isinstance(img, str) for img in images):
                raise ApiError(400, "images is a list of base64 strings.", param=f"messages[{i}].images",
                               code="invalid_request")
            msg["content"] = [{"type": "text", "text": msg["content"]}] + [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{img}"}} for img in images]
        if m.get("tool_calls"):
            msg["tool_calls"] = [_openai_call(c, j, f"messages[{i}].tool_calls[{j}]")
                                 for j, c in enumerate(_listed(m["tool_calls"], f"messages[{i}].tool_calls"))]
        if m.get("role") == "tool" and m.get("tool_name"):
            msg["name"] = m["tool_name"]
        out.append(msg)
    return out


def _listed(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise ApiError(400, f"{param} is a list.", param=param, code="invalid_request")
    return value


def _openai_call(call: Any, index: int, param: str) -> dict[str, Any]:
    """One Ollama tool call (`{"function": {"name", "arguments": {...}}}`) as OpenAI's, checked like any input."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, "A tool call is {\"function\": {\"name\": ..., \"arguments\": {...}}}.",
                       param=f"{param}.function", code="invalid_request")
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": fn["name"], "arguments": json.dumps(fn.get("arguments") or {})}}


def ollama_tool_calls(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not calls:
        return None
    out = []
    for c in calls:
        fn = c.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = {"arguments": fn.get("arguments")}
        out.append({"function": {"name": fn.get("name", ""), "arguments": args}})
    return out


def _done(call: Call, final: Final, reason: str | None) -> dict[str, Any]:
    """What Ollama's last object carries: why it stopped, the token counts and the durations in nanoseconds: the
    engine's own timings where it gives them (llama-server does), else as measured here, from the first token
    (a whole answer has no first token to tell reading the prompt from generating: its time is all `eval`)."""
    total = int((time.monotonic() - call.started) * 1e9)
    u = final.usage
    if u.prompt_ms or u.generate_ms:
        prompt, gen = int(u.prompt_ms * 1e6), int(u.generate_ms * 1e6)
    else:
        prompt = int((call.ttft_s or 0) * 1e9) if call.streamed else 0
        gen = max(0, total - prompt)
    return {"done": True, "done_reason": reason or "stop", "total_duration": total, "load_duration": 0,
            "prompt_eval_count": u.prompt_tokens, "prompt_eval_duration": prompt,
            "eval_count": u.completion_tokens, "eval_duration": gen}


class ToolCalls:
    """A stream's tool calls, put together from OpenAI's deltas (a name, then its arguments' JSON in pieces): Ollama
    streams each call whole, in a line of its own before the last."""

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, deltas: Any) -> None:
        for d in deltas if isinstance(deltas, list) else ():
            if not isinstance(d, dict):
                continue
            fn = d.get("function") if isinstance(d.get("function"), dict) else {}
            call = self.calls.setdefault(int(d.get("index") or 0), {"function": {"name": "", "arguments": ""}})
            for part in ("name", "arguments"):
                if isinstance(fn.get(part), str):
                    call["function"][part] += fn[part]

    def line(self, model: str) -> bytes:
        if not self.calls:
            return b""
        calls = ollama_tool_calls([self.calls[i] for i in sorted(self.calls)])
        return _line({"model": model, "created_at": _now(), "message": {"role": "assistant", "content": "",
                      "tool_calls": calls}, "done": False})


def _chat_piece(model: str, tools: ToolCalls, frame: Chunk) -> bytes:
    delta = frame.delta or {}
    if delta.get("tool_calls"):
        tools.add(delta["tool_calls"])
        if not delta.get("content") and not delta.get("reasoning_content"):
            return b""
    return _line({"model": model, "created_at": _now(), "message": {"role": "assistant",
                  "content": delta.get("content") or "", **({"thinking": delta["reasoning_content"]}
                                                           if delta.get("reasoning_content") else {})},
                  "done": False})


def _generate_piece(model: str, frame: Chunk) -> bytes:
    delta = frame.delta or {}
    return _line({"model": model, "created_at": _now(), "response": frame.text or delta.get("content") or "",
                  "done": False})


def _ollama_error(_: Request, exc: ApiError) -> Response:
    """Ollama's error shape, `{"error": "<message>"}`, with the same status (and Retry-After) as the OpenAI routes."""
    return Response(content=msgspec.json.encode({"error": exc.message}), status_code=exc.status,
                    media_type="application/json", headers=exc.headers)


class OllamaController(OllamaModelRoutes):
    path = "/api"
    exception_handlers = {ApiError: _ollama_error}

    @get("/version")
    async def version(self) -> Response:
        return json_response({"version": VERSION})

    async def _touch(self, request: Request, model: str, keep: Any, stream: bool, chat: bool) -> Response:
        """Ollama's idioms for loading a model (no messages, or an empty prompt) and unloading it (the same with
        `keep_alive: 0`): the model is loaded (by an empty job any of its engines answers at once, loading it on
        demand first), its keep-alive set as the request says, and nothing generated."""
        keep_s = keep_alive(keep)
        job = ChatJob(request_id=RequestId(new_request_id()), model=model, messages=[])
        call = Call(self.gw, self.caller(request), "chat", job, keep_alive_s=keep_s)
        await answer(call, request)
        reason = "unload" if call.keep_alive_s == 0 else "load"  # a tenant's 0 is not applied (pipeline.tenant_keep_alive)
        body = {"model": model, "created_at": _now(), **({"message": {"role": "assistant", "content": ""}} if chat
                                                           else {"response": ""}), "done_reason": reason, "done": True}
        if stream:
            return Stream(iter([_line(body)]), media_type=NDJSON, headers=call.response_headers())
        return json_response(body, headers=call.response_headers())

    @post("/chat", status_code=200)
    async def chat(self, request: Request) -> Response | Stream:
        req = await read_json(request, ChatRequest, any_type=True)
        if not req.messages:
            return await self._touch(request, req.model, req.keep_alive, req.stream, chat=True)
        job = ChatJob(request_id=RequestId(new_request_id()), model=req.model, messages=openai_messages(req.messages),
                      params=params(req.options), tools=req.tools or None, stream=req.stream,
                      response_format=response_format(req.format))
        call = Call(self.gw, self.caller(request), "chat", job, keep_alive_s=keep_alive(req.keep_alive))
        if not job.stream:
            final = await answer(call, request)
            choice = final.choices[0] if final.choices else None
            message = dict(choice.message or {}) if choice else {}
            body = {"model": req.model, "created_at": _now(),
                    "message": {"role": "assistant", "content": message.get("content") or "",
                                **({"tool_calls": t} if (t := ollama_tool_calls(message.get("tool_calls"))) else {})},
                    **_done(call, final, choice.finish_reason if choice else None)}
            return json_response(body, headers=call.response_headers())
        tools = ToolCalls()  # streamed with tools too (Open WebUI always sends them): each call whole, before the last
        return await _stream(call, request, partial(_chat_piece, req.model, tools),
                             lambda final: {"model": req.model, "created_at": _now(),
                                            "message": {"role": "assistant", "content": ""}},
                             before_last=lambda: tools.line(req.model))

    @post("/generate", status_code=200)
    async def generate(self, request: Request) -> Response | Stream:
        req = await read_json(request, GenerateRequest, any_type=True)
        if not req.prompt and not req.system:
            return await self._touch(request, req.model, req.keep_alive, req.stream, chat=False)
        rid = RequestId(new_request_id())
        if req.raw:
            job: Any = CompletionJob(request_id=rid, model=req.model, prompt=req.prompt, params=params(req.options),
                                     stream=req.stream)
            op = "complete"
        else:
            messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
                {"role": "user", "content": req.prompt}]
            job = ChatJob(request_id=rid, model=req.model, messages=messages, params=params(req.options),
                          stream=req.stream, response_format=response_format(req.format))
            op = "chat"
        call = Call(self.gw, self.caller(request), op, job, keep_alive_s=keep_alive(req.keep_alive))
        if not req.stream:
            final = await answer(call, request)
            choice = final.choices[0] if final.choices else None
            text = (choice.text if op == "complete" else (choice.message or {}).get("content")) if choice else ""
            return json_response({"model": req.model, "created_at": _now(), "response": text or "",
                                  **_done(call, final, choice.finish_reason if choice else None)},
                                 headers=call.response_headers())
        return await _stream(call, request, partial(_generate_piece, req.model),
                             lambda final: {"model": req.model, "created_at": _now(), "response": ""})

    @post("/embed", status_code=200)
    async def embed(self, request: Request) -> Response:
        req = await read_json(request, EmbedRequest, any_type=True)
        texts = [req.input] if isinstance(req.input, str) else list(req.input)
        if not texts or any(not t for t in texts):
            raise ApiError(400, "'input' must be text, or a list of texts, none of them empty.", param="input",
                           code="invalid_value")
        job = EmbedJob(request_id=RequestId(new_request_id()), model=req.model, input=texts, dimensions=req.dimensions)
        call = Call(self.gw, self.caller(request), "embed", job, keep_alive_s=keep_alive(req.keep_alive))
        final = await answer(call, request)
        return json_response({"model": req.model, "embeddings": formats.vectors(final.output),
                              "total_duration": int((time.monotonic() - call.started) * 1e9), "load_duration": 0,
                              "prompt_eval_count": final.usage.prompt_tokens}, headers=call.response_headers())


    @post("/embeddings", status_code=200)
    async def embeddings(self, request: Request) -> Response:
        """The older embeddings route: one `prompt`, one `embedding`."""
        req = await read_json(request, EmbeddingsRequest, any_type=True)
        if not req.prompt:
            raise ApiError(400, "'prompt' must be a non-empty text.", param="prompt", code="invalid_value")
        job = EmbedJob(request_id=RequestId(new_request_id()), model=req.model, input=[req.prompt])
        call = Call(self.gw, self.caller(request), "embed", job, keep_alive_s=keep_alive(req.keep_alive))
        final = await answer(call, request)
        return json_response({"embedding": formats.vectors(final.output)[0]}, headers=call.response_headers())


async def _stream(call: Call, request: Request, chunk: Any, head: Any, before_last: Any = None) -> Stream:
    """NDJSON: an object per piece, then (`before_last()`: the tool calls) one with `done` and the counts; an engine
    failure mid-stream is a last `{"error": ...}` line, as Ollama writes it."""
    reason: list[str | None] = [None]  # a streamed answer's finish reason rides on its last chunk

    def piece(frame: Chunk) -> bytes:
        if frame.finish_reason:
            reason[0] = frame.finish_reason
        return chunk(frame)

    async def final(frame: Final) -> bytes:
        return (before_last() if before_last else b"") + _line({**head(frame), **_done(call, frame, reason[0])})

    # no keep-alive while a model loads: Ollama's clients read every line as JSON (and Ollama sends none either)
    pieces = await open_stream(call, request, piece, final, lambda err: _line({"error": err.message}), None)
    return Stream(pieces, media_type=NDJSON, headers=call.response_headers())
