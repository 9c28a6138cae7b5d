"""`GET /v1/models` and `GET /v1/models/{id}`: OpenAI's model objects, plus what each model is for and whether it is
loaded now."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, delete, get
from litestar.params import FromPath

from coderai.contracts import ModelConfig
from coderai.contracts.admin import RemoveModelRequest
from coderai.contracts.subjects import CMD_SCHEDULER_REMOVE
from coderai.contracts.ops import kind_of
from coderai.gateway.admin.models import change_model
from coderai.gateway.copies import Copy
from coderai.gateway.errors import ApiError
from coderai.gateway.http import json_response
from coderai.gateway.state import InferenceController


def model_json(m: ModelConfig, copies: list[Copy], admin: bool) -> dict[str, Any]:
    """OpenAI's model object, plus `kind` (its first op's kind), `capabilities` (every op's), `engine` and `coderai`
    (`residency`)."""
    ops = m.serves()
    return {
        "id": m.name,
        "object": "model",
        "created": m.created,
        "owned_by": m.owned_by,
        "kind": kind_of(ops[0]) if ops else "unknown",
        "capabilities": [kind_of(o) for o in ops],
        "engine": m.engine,
        "coderai": residency(m, copies, admin),
        **output_limits(m),
    }


def output_limits(m: ModelConfig) -> dict[str, int]:
    """What a request's output is held to, where the models file says: `max_output_tokens` (the ceiling) and
    `default_output_tokens` (when a request names none), as OpenAI-compatible servers state a model's limits."""
    limits = {"max_output_tokens": m.max_output_tokens, "default_output_tokens": m.default_output_tokens}
    if isinstance(n_ctx := m.params.get("n_ctx"), int) and n_ctx > 0:
        limits["context_length"] = n_ctx
    return {k: v for k, v in limits.items() if v}


def residency(m: ModelConfig, copies: list[Copy], admin: bool) -> dict[str, Any]:
    """Whether a request would find `m` loaded: `loaded` (a ready copy on a live node), `copies` (how many are
    ready), `loading` (one is being loaded now), `resident` (how it is held: always, on_demand or auto) and, for an
    admin key only (a tenant need not learn the cluster's machines), the `nodes` holding a ready copy."""
    ready = [c for c in copies if c.status.state == "ready"]
    out: dict[str, Any] = {
        "loaded": bool(ready),
        "copies": len(ready),
        "loading": any(c.status.state == "loading" for c in copies),
        "resident": m.resident or "auto",
    }
    if admin:
        out["nodes"] = sorted({c.node_id for c in ready})
    return out


class ModelsController(InferenceController):
    path = "/v1/models"

    @get("/")
    async def list_models(self, request: Request) -> Response:
        """The models this key may use (all of them for a key without an allow-list)."""
        who = self.caller(request)
        copies, admin = self.gw.copies.by_model(), "admin" in who.scopes
        data = [model_json(m, copies.get(m.name, []), admin) for m in await self.gw.visible_models(who)]
        return json_response({"object": "list", "data": data})

    @get("/{model_id:path}")
    async def get_model(self, request: Request, model_id: FromPath[str]) -> Response:
        who = self.caller(request)
        m = await self.gw.visible_model(who, model_id.lstrip("/"))
        return json_response(model_json(m, self.gw.copies.by_model().get(m.name, []), "admin" in who.scopes))

    @delete("/{model_id:path}", status_code=200)
    async def delete_model(self, request: Request, model_id: FromPath[str]) -> Response:
        """OpenAI's delete of a fine-tuned model, by the key that trained it (or an admin key); another key's is as
        absent as a missing one. The operator's own models are changed under `/admin/models`, not here."""
        who = self.caller(request)
        m = await self.gw.visible_model(who, model_id.lstrip("/"))
        if not m.owner:
            raise ApiError(
                403,
                f"'{m.name}' is not a fine-tuned model of this key; the operator removes it with "
                "DELETE /admin/models/{name}.",
                type="invalid_request_error",
                code="model_not_deletable",
            )
        await change_model(self.gw, CMD_SCHEDULER_REMOVE, RemoveModelRequest(name=m.name), m.name)
        return json_response({"id": m.name, "object": "model", "deleted": True})
