"""Admin HTTP for the served models (admin keys only): add, replace, remove one, and see its config and where it is
assigned. The scheduler owns the set (and its models file); these routes check the config and relay.

A body is a models-file entry as JSON (`{"name", "engine", "path", "params", ...}`), checked field by field: an
invalid one is a 400 naming the field. `/admin/models/pull...` and `/admin/models/pulled` are the catalogue's
(`catalog.py`), so models of those names are refused."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post, put
from litestar.params import FromPath

from coderai.contracts import BusError, ModelConfig
from coderai.contracts.admin import AddModelRequest, NodesRequest, PlaceReply, RemoveModelRequest
from coderai.contracts.subjects import CMD_SCHEDULER_ADD, CMD_SCHEDULER_NODES, CMD_SCHEDULER_REMOVE, Subject
from coderai.gateway.admin.nodes import ask
from coderai.gateway.errors import ApiError, from_bus, unknown_model
from coderai.gateway.http import json_response, parse, read_json
from coderai.gateway.state import AdminController, Gateway

RESERVED = frozenset({"pull", "pulled"})  # path segments of the catalogue's routes under /admin/models


def checked_name(name: str) -> str:
    """A new model's name; `pull` and `pulled` are refused, as their paths are the catalogue's routes (a PUT or
    DELETE there is a 405) and the model could not be shown, replaced or removed over HTTP."""
    if not name:
        raise ApiError(400, "A model needs a non-empty 'name'.", param="name", code="invalid_value")
    if name in RESERVED:
        raise ApiError(
            400,
            f"A model may not be named {name!r}: /admin/models/{name} is the catalogue's route.",
            param="name",
            code="invalid_value",
        )
    return name


def _not_found(name: str) -> ApiError:
    return unknown_model(name, param="name")


async def change_model(
    gw: Gateway, subject: Subject[AddModelRequest | RemoveModelRequest, PlaceReply], msg: msgspec.Struct, name: str
) -> dict[str, Any]:
    """The scheduler's answer to a change: the config it now serves (or just removed)."""
    try:
        reply = await gw.bus.request(subject, msg, timeout=5.0)
    except BusError as exc:
        if exc.code == "not_found":
            raise _not_found(name) from None
        if exc.code == "conflict":
            raise ApiError(
                409,
                f"A model named '{name}' exists already; PUT /admin/models/{name} replaces it.",
                param="name",
                code="model_exists",
            ) from None
        raise from_bus(exc, gw.settings.retry_after_s) from None
    return msgspec.to_builtins(reply.model)


class LiveModelsController(AdminController):
    path = "/admin/models"

    @post("/", status_code=201)
    async def create(self, request: Request) -> Response:
        """A new model, served at once; 409 if the name is taken."""
        cfg = await read_json(request, ModelConfig)
        name = checked_name(cfg.name)
        return json_response(
            {"model": await change_model(self.gw, CMD_SCHEDULER_ADD, AddModelRequest(model=cfg, replace=False), name)},
            201,
        )

    @put("/{name:str}", status_code=200)
    async def replace(self, request: Request, name: FromPath[str]) -> Response:
        """Create or replace model `name`; the body may leave `name` out, and may not name another model."""
        doc = await read_json(request, dict[str, Any])
        if doc.setdefault("name", name) != name:
            raise ApiError(
                400, f"The body names model {doc['name']!r}, the path {name!r}.", param="name", code="invalid_value"
            )
        cfg = parse(msgspec.json.encode(doc), ModelConfig)
        return json_response(
            {"model": await change_model(self.gw, CMD_SCHEDULER_ADD, AddModelRequest(model=cfg), name)}
        )

    @delete("/{name:str}", status_code=200)
    async def remove(self, name: FromPath[str]) -> Response:
        """Stop serving `name`: new requests get a 404 at once, in-flight ones finish first (the worker unloads it
        after them, within its drain timeout)."""
        cfg = await change_model(self.gw, CMD_SCHEDULER_REMOVE, RemoveModelRequest(name=name), name)
        return json_response({"model": cfg, "deleted": True})

    @get("/{name:str}")
    async def show(self, name: FromPath[str]) -> Response:
        """The served config of `name`, the nodes it is assigned to with its engine's state on each, and why it is
        unplaced (if it is)."""
        cfg = self.gw.catalog.models.get(name)
        if cfg is None:
            raise _not_found(name)
        reply = await ask(self.gw, CMD_SCHEDULER_NODES, NodesRequest())
        nodes = [
            {
                "node_id": n.heartbeat.node_id,
                "state": next((e.state for e in n.heartbeat.engines if e.model == name), "assigned"),
            }
            for n in reply.nodes
            if name in n.assigned
        ]
        return json_response(
            {"model": msgspec.to_builtins(cfg), "nodes": nodes, "unplaced": reply.unplaced.get(name, "")}
        )
