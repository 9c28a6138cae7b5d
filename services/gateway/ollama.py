"""Ollama's API (`/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`, `/api/version`; the model routes,
`/api/tags`, `/api/show`, `/api/pull`, `/api/create`, ..., are `ollama_models`'), so the `ollama` client, Open
WebUI's Ollama connection and every Ollama integration work against coderai: the same pipeline as the OpenAI
endpoints, answers streamed as NDJSON (Ollama's default) or whole. The key goes in the `Authorization` header, as the clients send it when given one.

The requests and their translation are `ollama_types`'; the answers' shapes `ollama_answers`'."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.response import Stream

from coderai.contracts import ChatJob, CompletionJob, EmbedJob, EmbedResult, RequestId
from coderai.gateway.errors import ApiError
from coderai.gateway.http import json_response, new_request_id, read_json
from coderai.gateway.ollama_answers import (
    ToolCalls,
    chat_piece,
    done_fields,
    generate_piece,
    ndjson_stream,
    ollama_tool_calls,
)
from coderai.gateway.ollama_models import FOREVER as FOREVER  # re-exported, as running_json: tests import them here
from coderai.gateway.ollama_models import OllamaModelRoutes
from coderai.gateway.ollama_models import running_json as running_json
from coderai.gateway.ollama_types import (
    NDJSON,
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    keep_alive,
    openai_messages,
    params,
    response_format,
)
from coderai.gateway.ollama_types import line as _line
from coderai.gateway.ollama_types import now as _now
from coderai.gateway.openai import formats
from coderai.gateway.pipeline import Call, answer, touch

VERSION = "0.12.0"  # the Ollama API version these routes follow (clients gate features on it)


def _ollama_error(_: Request, exc: ApiError) -> Response:
    """Ollama's error shape, `{"error": "<message>"}`, with the same status (and Retry-After) as the OpenAI routes."""
    return Response(
        content=msgspec.json.encode({"error": exc.message}),
        status_code=exc.status,
        media_type="application/json",
        headers=exc.headers,
    )


class OllamaController(OllamaModelRoutes):
    path = "/api"
    exception_handlers = {ApiError: _ollama_error}

    @get("/version")
    async def version(self) -> Response:
        return json_response({"version": VERSION})

    async def _touch(self, request: Request, model: str, keep: object, stream: bool, chat: bool) -> Response:
        """Ollama's idioms for loading a model (no messages, or an empty prompt) and unloading it (the same with
        `keep_alive: 0`): the model is loaded (by an empty job any of its engines answers at once, loading it on
        demand first), its keep-alive set as the request says, and nothing generated."""
        call = await touch(self.gw, self.caller(request), model, keep_alive(keep), request)
        reason = (
            "unload" if call.keep_alive_s == 0 else "load"
        )  # a tenant's 0 is not applied (pipeline_admit.tenant_keep_alive)
        body = {
            "model": model,
            "created_at": _now(),
            **({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}),
            "done_reason": reason,
            "done": True,
        }
        if stream:
            return Stream(iter([_line(body)]), media_type=NDJSON, headers=call.response_headers())
        return json_response(body, headers=call.response_headers())

    @post("/chat", status_code=200)
    async def chat(self, request: Request) -> Response | Stream:
        req = await read_json(request, ChatRequest, any_type=True)
        if not req.messages:
            return await self._touch(request, req.model, req.keep_alive, req.stream, chat=True)
        job = ChatJob(
            request_id=RequestId(new_request_id()),
            model=req.model,
            messages=openai_messages(req.messages),
            params=params(req.options),
            tools=req.tools or None,
            stream=req.stream,
            response_format=response_format(req.format),
        )
        call = Call(self.gw, self.caller(request), "chat", job, keep_alive_s=keep_alive(req.keep_alive))
        if not job.stream:
            final = await answer(call, request)
            choice = final.choices[0] if final.choices else None
            message = dict(choice.message or {}) if choice else {}
            body = {
                "model": req.model,
                "created_at": _now(),
                "message": {
                    "role": "assistant",
                    "content": message.get("content") or "",
                    **({"tool_calls": t} if (t := ollama_tool_calls(message.get("tool_calls"))) else {}),
                },
                **done_fields(call, final, choice.finish_reason if choice else None),
            }
            return json_response(body, headers=call.response_headers())
        tools = ToolCalls()  # streamed with tools too (Open WebUI always sends them): each call whole, before the last
        return await ndjson_stream(
            call,
            request,
            partial(chat_piece, req.model, tools),
            lambda final: {"model": req.model, "created_at": _now(), "message": {"role": "assistant", "content": ""}},
            before_last=lambda: tools.line(req.model),
        )

    @post("/generate", status_code=200)
    async def generate(self, request: Request) -> Response | Stream:
        req = await read_json(request, GenerateRequest, any_type=True)
        if not req.prompt and not req.system:
            return await self._touch(request, req.model, req.keep_alive, req.stream, chat=False)
        rid = RequestId(new_request_id())
        if req.raw:
            job: Any = CompletionJob(
                request_id=rid, model=req.model, prompt=req.prompt, params=params(req.options), stream=req.stream
            )
            op = "complete"
        else:
            messages: list[dict[str, object]] = [{"role": "system", "content": req.system}] if req.system else []
            messages.append({"role": "user", "content": req.prompt})
            job = ChatJob(
                request_id=rid,
                model=req.model,
                messages=messages,
                params=params(req.options),
                stream=req.stream,
                response_format=response_format(req.format),
            )
            op = "chat"
        call = Call(self.gw, self.caller(request), op, job, keep_alive_s=keep_alive(req.keep_alive))
        if not req.stream:
            final = await answer(call, request)
            choice = final.choices[0] if final.choices else None
            text = (choice.text if op == "complete" else (choice.message or {}).get("content")) if choice else ""
            return json_response(
                {
                    "model": req.model,
                    "created_at": _now(),
                    "response": text or "",
                    **done_fields(call, final, choice.finish_reason if choice else None),
                },
                headers=call.response_headers(),
            )
        return await ndjson_stream(
            call,
            request,
            partial(generate_piece, req.model),
            lambda final: {"model": req.model, "created_at": _now(), "response": ""},
        )

    @post("/embed", status_code=200)
    async def embed(self, request: Request) -> Response:
        req = await read_json(request, EmbedRequest, any_type=True)
        texts = [req.input] if isinstance(req.input, str) else list(req.input)
        if not texts or any(not t for t in texts):
            raise ApiError(
                400,
                "'input' must be text, or a list of texts, none of them empty.",
                param="input",
                code="invalid_value",
            )
        job = EmbedJob(request_id=RequestId(new_request_id()), model=req.model, input=texts, dimensions=req.dimensions)
        call = Call(self.gw, self.caller(request), "embed", job, keep_alive_s=keep_alive(req.keep_alive))
        final = await answer(call, request)
        return json_response(
            {
                "model": req.model,
                "embeddings": formats.vectors(formats.result(final, EmbedResult)),
                "total_duration": int((time.monotonic() - call.started) * 1e9),
                "load_duration": 0,
                "prompt_eval_count": final.usage.prompt_tokens,
            },
            headers=call.response_headers(),
        )

    @post("/embeddings", status_code=200)
    async def embeddings(self, request: Request) -> Response:
        """The older embeddings route: one `prompt`, one `embedding`."""
        req = await read_json(request, EmbeddingsRequest, any_type=True)
        if not req.prompt:
            raise ApiError(400, "'prompt' must be a non-empty text.", param="prompt", code="invalid_value")
        job = EmbedJob(request_id=RequestId(new_request_id()), model=req.model, input=[req.prompt])
        call = Call(self.gw, self.caller(request), "embed", job, keep_alive_s=keep_alive(req.keep_alive))
        final = await answer(call, request)
        return json_response(
            {"embedding": formats.vectors(formats.result(final, EmbedResult))[0]}, headers=call.response_headers()
        )
