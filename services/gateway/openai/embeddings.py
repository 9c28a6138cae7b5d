"""`POST /v1/embeddings` and `POST /v1/rerank` (the Jina/Cohere shape): items fan out over every worker holding
the model when its `distribute` settings allow."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from litestar import Request, Response, post
from msgspec import Meta

from coderai.contracts import EmbedJob, EmbedResult, RequestId, RerankJob, RerankResult
from coderai.gateway.errors import ApiError
from coderai.gateway.http import json_response, new_request_id, read_json
from coderai.gateway.openai import formats
from coderai.gateway.openai.forms import NonEmpty
from coderai.gateway.pipeline import Call, answer
from coderai.gateway.state import InferenceController


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list[str | int | list[int]]  # token ids parse, and are refused with a clear message
    model: NonEmpty
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None


class RerankDocument(msgspec.Struct):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    model: NonEmpty
    query: NonEmpty
    documents: Annotated[list[str | RerankDocument], Meta(min_length=1, max_length=4096)]
    top_n: Annotated[int, Meta(ge=1)] | None = None
    return_documents: bool = True


def embed_job(req: EmbeddingRequest, request_id: str) -> EmbedJob:
    given = [req.input] if isinstance(req.input, str) else req.input
    if not given:
        raise ApiError(400, "'input' must not be empty.", param="input", code="invalid_value")
    texts = [t for t in given if isinstance(t, str)]
    if len(texts) < len(given):
        raise ApiError(400, "Token-id input is not supported here; send the text.", param="input", code="invalid_value")
    if any(not t for t in texts):
        raise ApiError(400, "'input' must not contain empty strings.", param="input", code="invalid_value")
    return EmbedJob(request_id=RequestId(request_id), model=req.model, input=texts, dimensions=req.dimensions)


class EmbeddingsController(InferenceController):
    @post("/v1/embeddings", status_code=200)
    async def embeddings(self, request: Request) -> Response:
        who = self.caller(request)
        req = await read_json(request, EmbeddingRequest)
        call = Call(self.gw, who, "embed", embed_job(req, new_request_id()))
        final = await answer(call, request)
        return json_response(
            formats.embeddings(formats.result(final, EmbedResult), req.model, req.encoding_format, final.usage),
            headers=call.response_headers(),
        )

    @post("/v1/rerank", status_code=200)
    async def rerank(self, request: Request) -> Response:
        who = self.caller(request)
        req = await read_json(request, RerankRequest)
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        job = RerankJob(request_id=RequestId(new_request_id()), model=req.model, query=req.query, documents=docs)
        call = Call(self.gw, who, "rerank", job)
        final = await answer(call, request)
        body = formats.rerank(
            job.request_id,
            formats.result(final, RerankResult).scores,
            docs,
            req.model,
            req.top_n,
            req.return_documents,
            final.usage,
        )
        return json_response(body, headers=call.response_headers())
