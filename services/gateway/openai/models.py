"""`GET /v1/models` and `GET /v1/models/{id}`: OpenAI's model objects, plus what each model is for."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get
from litestar.params import FromPath

from coderai.contracts import ModelConfig
from coderai.contracts.ops import kind_of
from coderai.gateway.http import json_response
from coderai.gateway.state import InferenceController


def model_json(m: ModelConfig) -> dict[str, Any]:
    """OpenAI's model object, plus `kind` (its first op's kind), `capabilities` (every op's) and `engine`."""
    ops = m.serves()
    return {"id": m.name, "object": "model", "created": m.created, "owned_by": m.owned_by,
            "kind": kind_of(ops[0]) if ops else "unknown", "capabilities": [kind_of(o) for o in ops],
            "engine": m.engine}


class ModelsController(InferenceController):
    path = "/v1/models"

    @get("/")
    async def list_models(self, request: Request) -> Response:
        """The models this key may use (all of them for a key without an allow-list)."""
        data = [model_json(m) for m in self.gw.visible_models(self.caller(request))]
        return json_response({"object": "list", "data": data})

    @get("/{model_id:path}")
    async def get_model(self, request: Request, model_id: FromPath[str]) -> Response:
        return json_response(model_json(self.gw.visible_model(self.caller(request), model_id.lstrip("/"))))
