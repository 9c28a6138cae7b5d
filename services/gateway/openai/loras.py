"""`/v1/loras`: the LoRA adapters fine-tuning made, as the key that trained them sees them (coderai's extension).

An adapter is served as the model `<base>:<suffix>-<id>` (docs/finetuning.md); this API is the same models seen as
adapters, owner-scoped exactly as they are: a key lists, reads, loads, unloads and deletes only its own (an admin
key every one); another key's adapter is as absent as a missing one (404), never a 403 that says it exists.

- `GET /v1/loras`, `GET /v1/loras/{name}`: `{"id", "object": "lora", "base", "engine", "created", "owned_by",
  "coderai": residency}` (`loaded`, `copies`, `loading`, as `GET /v1/models` says).
- `POST /v1/loras/{name}/load` (body optional: `{"keep_alive": seconds}`): the adapter is loaded on an engine now,
  not at its first request, and kept loaded idle that long (a tenant up to the longer of its own idle time and an
  hour, as Ollama's keep_alive is bounded).
- `POST /v1/loras/{name}/unload`: its engines let it go once idle. A tenant may unload its own adapter (no other
  key can use it), not a model others share.
- `DELETE /v1/loras/{name}`: the adapter's model removed (as `DELETE /v1/models/{name}`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.params import FromPath

from coderai.contracts import ModelConfig
from coderai.contracts.admin import RemoveModelRequest
from coderai.contracts.subjects import CMD_SCHEDULER_REMOVE
from coderai.gateway.admin.models import change_model
from coderai.gateway.errors import ApiError
from coderai.gateway.http import json_response, read_json
from coderai.gateway.openai.models import residency
from coderai.gateway.pipeline import touch
from coderai.gateway.state import InferenceController
from coderai.runtime.lifecycle import wait_for

RECORD_WAIT_S = 5.0
"""How long a load waits for the cluster's record to show the copy that answered it (a heartbeat is sent at each load)."""


class LoadRequest(msgspec.Struct, forbid_unknown_fields=True):
    keep_alive: float | None = None  # seconds the adapter stays loaded idle; None: its model's own policy


def base_of(m: ModelConfig) -> str:
    """The base model's name: a fine-tuned model is named `<base>:<suffix>-<id>` (or `<base>:<job id>`)."""
    return m.name.rsplit(":", 1)[0]


class LorasController(InferenceController):
    path = "/v1/loras"

    def _json(self, m: ModelConfig, admin: bool) -> dict[str, Any]:
        return {
            "id": m.name,
            "object": "lora",
            "base": base_of(m),
            "engine": m.engine,
            "created": m.created,
            "owned_by": m.owned_by,
            **({"owner": m.owner} if admin else {}),
            "coderai": residency(m, self.gw.copies.by_model().get(m.name, []), admin),
        }

    async def _adapter(self, request: Request, name: str) -> tuple[ModelConfig, bool]:
        """The key's own adapter `name` (any, for an admin key); a model that is not an adapter is as absent."""
        who = self.caller(request)
        m = await self.gw.visible_model(who, name)
        if not m.owner:
            raise ApiError(404, f"No LoRA adapter named '{name}'.", type="invalid_request_error", code="lora_not_found")
        return m, "admin" in who.scopes

    @get("/")
    async def list_loras(self, request: Request) -> Response:
        who = self.caller(request)
        admin = "admin" in who.scopes
        data = [self._json(m, admin) for m in await self.gw.visible_models(who) if m.owner]
        return json_response({"object": "list", "data": data})

    @get("/{name:str}")
    async def get_lora(self, request: Request, name: FromPath[str]) -> Response:
        m, admin = await self._adapter(request, name)
        return json_response(self._json(m, admin))

    @post("/{name:str}/load", status_code=200)
    async def load(self, request: Request, name: FromPath[str]) -> Response:
        m, admin = await self._adapter(request, name)
        req = await read_json(request, LoadRequest, empty=b"{}")
        if req.keep_alive is not None and req.keep_alive < 0:
            raise ApiError(400, "keep_alive must be 0 or more seconds", param="keep_alive")
        await touch(self.gw, self.caller(request), m.name, req.keep_alive, request)
        # an engine answered, so it is loaded; the cluster's record of it comes with the node's next heartbeat,
        # which can be a moment behind the answer (an engine that was just loaded answers an empty job at once)
        with contextlib.suppress(TimeoutError):  # then the record as it stands (a heartbeat lost): the load worked
            await wait_for(
                lambda: self._json(m, admin)["coderai"]["loaded"], RECORD_WAIT_S, what=f"the record of {m.name}'s copy"
            )
        return json_response(self._json(m, admin))

    @post("/{name:str}/unload", status_code=200)
    async def unload(self, request: Request, name: FromPath[str]) -> Response:
        m, admin = await self._adapter(request, name)
        await touch(self.gw, self.caller(request), m.name, 0.0, request)
        return json_response(self._json(m, admin))

    @delete("/{name:str}", status_code=200)
    async def delete_lora(self, request: Request, name: FromPath[str]) -> Response:
        m, _ = await self._adapter(request, name)
        await change_model(self.gw, CMD_SCHEDULER_REMOVE, RemoveModelRequest(name=m.name), m.name)
        return json_response({"id": m.name, "object": "lora", "deleted": True})
