"""Admin HTTP (admin-scoped keys only): nodes, a node's logs, drain, and model placement.

Each route is a thin bridge to one bus command; the scheduler and the workers own the state."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, get, post

from coderai.contracts import BusError
from coderai.contracts.admin import DrainRequest, NodeLogsRequest, NodesRequest, PlaceRequest
from coderai.contracts.subjects import CMD_NODE_DRAIN, CMD_NODE_LOGS, CMD_SCHEDULER_NODES, CMD_SCHEDULER_PLACE, check_token
from coderai.gateway.errors import ApiError, from_bus

JSON = "application/json"


def admin_routes(gw: Any, caller) -> list:
    """Route handlers bound to the gateway state `gw`; `caller(request, scope)` authenticates."""

    async def ask(subject, msg, **params: str) -> Response:
        try:
            reply = await gw.bus.request(subject, msg, timeout=5.0, **params)
        except BusError as exc:
            if exc.code == "no_engine" and "node_id" in params:
                raise ApiError(404, f"node {params['node_id']!r} is not reachable", code="node_not_found") from None
            raise from_bus(exc, gw.settings.retry_after_s) from None
        return Response(content=msgspec.json.encode(msgspec.to_builtins(reply)), media_type=JSON)

    def node_id(value: str) -> str:
        try:
            return check_token(value, "node id")
        except ValueError as exc:
            raise ApiError(400, str(exc), param="node_id") from None

    def body(raw: bytes, type_: type) -> Any:
        try:
            return msgspec.json.decode(raw or b"{}", type=type_)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ApiError(400, f"Invalid request: {exc}", code="invalid_request") from None

    @get("/admin/nodes")
    async def nodes(request: Request) -> Response:
        caller(request, "admin")
        return await ask(CMD_SCHEDULER_NODES, NodesRequest())

    @get("/admin/nodes/{nid:str}/logs")
    async def logs(request: Request, nid: str) -> Response:
        caller(request, "admin")
        try:
            lines = int(request.query_params.get("lines", "200"))
        except ValueError:
            raise ApiError(400, "lines must be an integer", param="lines") from None
        return await ask(CMD_NODE_LOGS, NodeLogsRequest(lines=max(1, min(lines, 2000))), node_id=node_id(nid))

    @post("/admin/nodes/{nid:str}/drain", status_code=200)
    async def drain(request: Request, nid: str) -> Response:
        caller(request, "admin")
        return await ask(CMD_NODE_DRAIN, body(await request.body(), DrainRequest), node_id=node_id(nid))

    class _Target(msgspec.Struct, forbid_unknown_fields=True):
        node: str

    async def placement(request: Request, model: str, action: str) -> Response:
        caller(request, "admin")
        target = body(await request.body(), _Target)
        return await ask(CMD_SCHEDULER_PLACE, PlaceRequest(model=model, node=target.node, action=action))  # type: ignore[arg-type]

    @post("/admin/models/{model:str}/place", status_code=200)
    async def place(request: Request, model: str) -> Response:
        return await placement(request, model, "place")

    @post("/admin/models/{model:str}/unplace", status_code=200)
    async def unplace(request: Request, model: str) -> Response:
        return await placement(request, model, "unplace")

    return [nodes, logs, drain, place, unplace]
