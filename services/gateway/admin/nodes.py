"""Admin HTTP for the cluster (admin keys only): nodes, models split over several nodes, a node's logs, drain,
and model placement. Each route is a thin bridge to one bus command; the scheduler and the workers own the state."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from litestar import Request, Response, get, post
from litestar.params import FromPath

from coderai import heads
from coderai.contracts import BusError, SplitPlan
from coderai.contracts.admin import DrainRequest, NodeLogsRequest, NodesRequest, PlaceRequest
from coderai.contracts.subjects import (
    CMD_NODE_DRAIN,
    CMD_NODE_LOGS,
    CMD_SCHEDULER_NODES,
    CMD_SCHEDULER_PLACE,
    Subject,
    check_token,
)
from coderai.contracts.topology import LEADERS
from coderai.gateway.errors import ApiError, from_bus
from coderai.gateway.http import json_response, read_json
from coderai.gateway.state import AdminController, Gateway
from coderai.runtime.leader import leaders


async def ask(gw: Gateway, subject: Subject, msg: msgspec.Struct, node_id: str | None = None) -> Any:
    """A bus command's reply (to a node's subject with `node_id`); its errors as the API's (a node that does not
    answer: 404)."""
    try:
        if node_id is None:
            return await gw.bus.request(subject, msg, timeout=5.0)
        return await gw.bus.request(subject, msg, timeout=5.0, node_id=node_id)
    except BusError as exc:
        if exc.code == "no_engine" and node_id is not None:
            raise ApiError(404, f"node {node_id!r} is not reachable", code="node_not_found") from None
        raise from_bus(exc, gw.settings.retry_after_s) from None


async def relay(gw: Gateway, subject: Subject, msg: msgspec.Struct, node_id: str | None = None) -> Response:
    """The command's reply as the answer's JSON."""
    return json_response(msgspec.to_builtins(await ask(gw, subject, msg, node_id)))


def _node(value: str) -> str:
    try:
        return check_token(value, "node id")
    except ValueError as exc:
        raise ApiError(400, str(exc), param="node_id") from None


class _Target(msgspec.Struct, forbid_unknown_fields=True):
    node: str


class NodesController(AdminController):
    @get("/nodes")
    async def nodes(self) -> Response:
        return await relay(self.gw, CMD_SCHEDULER_NODES, NodesRequest())

    @get("/cluster")
    async def cluster(self) -> Response:
        """Who leads each singleton (scheduler, pod broker) and the nodes heard from: `coderai status` shows it."""
        try:
            kv = await self.gw.bus.kv(LEADERS)
            held = await leaders(kv)
        except BusError as exc:
            raise from_bus(exc, self.gw.settings.retry_after_s) from None
        except Exception as exc:  # the bus is down or its JetStream not ready
            raise ApiError(
                503,
                f"the bus did not answer: {type(exc).__name__}",
                type="service_unavailable",
                code="bus_unavailable",
                headers={"Retry-After": str(self.gw.settings.retry_after_s)},
            ) from None
        nodes = [
            {
                "node_id": hb.node_id,
                "pod": hb.pod,
                "models": sorted({e.model for e in hb.engines}),
                "in_flight": sum(e.in_flight for e in hb.engines),
            }
            for hb in self.gw.copies.live()
        ]
        try:  # several heads (docs/ha.md): each as it recorded itself; none with one head
            urls = await heads.client_urls(self.gw.bus)
        except Exception:  # the heads' bucket not answering leaves the rest of the answer useful
            urls = []
        return json_response(
            {
                "object": "cluster",
                "leaders": [msgspec.to_builtins(i) for i in held],
                "nodes": sorted(nodes, key=lambda n: n["node_id"]),
                "heads": urls,
            }
        )

    @get("/splits")
    async def splits(self) -> Response:
        """Models split over several nodes: per device, its node, endpoint, share and the layers it holds."""
        reply = await ask(self.gw, CMD_SCHEDULER_NODES, NodesRequest())
        engine_warnings = {(n.heartbeat.node_id, e.model): e.warning for n in reply.nodes for e in n.heartbeat.engines}

        def warning(name: str, p: SplitPlan) -> str:  # the plan's (configured link) and the engine's (measured link)
            return "; ".join(w for w in (p.warning, engine_warnings.get((p.devices[0].node_id, name), "")) if w)

        data = [
            {
                "model": name,
                "serving_node": p.devices[0].node_id,
                "mode": p.mode,
                "n_layers": p.n_layers,
                "warning": warning(name, p),
                "devices": [
                    {"node_id": d.node_id, "endpoint": d.endpoint, "share": d.share, "layers": d.layers}
                    for d in p.devices
                ],
            }
            for name, p in sorted(reply.splits.items())
        ]
        return json_response({"object": "list", "data": data})

    @get("/nodes/{nid:str}/logs")
    async def logs(self, request: Request, nid: FromPath[str]) -> Response:
        try:
            lines = int(request.query_params.get("lines", "200"))
        except ValueError:
            raise ApiError(400, "lines must be an integer", param="lines") from None
        return await relay(self.gw, CMD_NODE_LOGS, NodeLogsRequest(lines=max(1, min(lines, 2000))), node_id=_node(nid))

    @post("/nodes/{nid:str}/drain", status_code=200)
    async def drain(self, request: Request, nid: FromPath[str]) -> Response:
        msg = await read_json(request, DrainRequest, empty=b"{}")
        return await relay(self.gw, CMD_NODE_DRAIN, msg, node_id=_node(nid))

    @post("/models/{model:str}/place", status_code=200)
    async def place(self, request: Request, model: FromPath[str]) -> Response:
        return await _placement(request, self.gw, model, "place")

    @post("/models/{model:str}/unplace", status_code=200)
    async def unplace(self, request: Request, model: FromPath[str]) -> Response:
        return await _placement(request, self.gw, model, "unplace")


async def _placement(request: Request, gw: Gateway, model: str, action: Literal["place", "unplace"]) -> Response:
    target = await read_json(request, _Target, empty=b"{}")
    return await relay(gw, CMD_SCHEDULER_PLACE, PlaceRequest(model=model, node=target.node, action=action))
