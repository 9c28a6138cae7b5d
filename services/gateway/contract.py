"""`GET /openapi.json`: the part of OpenAI's OpenAPI document that coderai implements, vendored beside this module
(`openapi/openai.json`, cut from OpenAI's spec by `scripts/openai_spec.py`) and checked by `tests/conformance`.

Public on purpose: it says which operations exist, as OpenAI's own published spec does, and holds no secret; a
client or a code generator may read it before it has a key."""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

import msgspec
from litestar import Response, get

from coderai.gateway.http import json_response
from coderai.gateway.state import GatewayController

CLAIMED: tuple[tuple[str, str], ...] = (
    ("get", "/models"),
    ("get", "/models/{model}"),
    ("post", "/chat/completions"),
    ("post", "/completions"),
    ("post", "/embeddings"),
    ("post", "/files"),
    ("get", "/files"),
    ("get", "/files/{file_id}"),
    ("delete", "/files/{file_id}"),
    ("get", "/files/{file_id}/content"),
    ("post", "/responses"),
    ("get", "/responses/{response_id}"),
    ("delete", "/responses/{response_id}"),
    ("get", "/responses/{response_id}/input_items"),
    ("post", "/responses/{response_id}/cancel"),
    ("post", "/batches"),
    ("get", "/batches"),
    ("get", "/batches/{batch_id}"),
    ("post", "/batches/{batch_id}/cancel"),
)
"""The OpenAI operations (method, path under `/v1`) coderai claims to implement as OpenAI's spec says: the one list
the vendored subset is cut from and the conformance suite runs."""

DOCUMENT = "openapi/openai.json"


@functools.cache
def document_bytes() -> bytes:
    """The vendored subset as served, read once from the installed package (package data, not the source tree)."""
    return resources.files("coderai.gateway").joinpath(DOCUMENT).read_bytes()


def load_document() -> dict[str, Any]:
    return json.loads(document_bytes())


class ContractController(GatewayController):
    @get("/openapi.json")
    async def openapi(self) -> Response:
        return json_response(msgspec.Raw(document_bytes()))
