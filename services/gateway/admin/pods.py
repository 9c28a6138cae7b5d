"""Admin HTTP for rented pods (admin keys only): the pod-broker's pods and live cost, a warm floor (lease), and
pod spend and reservations by model from the broker's ledger in Redis."""

from __future__ import annotations

import msgspec
from litestar import Request, Response, get, post

from coderai.accounts.pod_money import PodMoney
from coderai.contracts.pods import BrokerStatusRequest, LeaseRequest
from coderai.contracts.subjects import CMD_BROKER_LEASE, CMD_BROKER_STATUS
from coderai.gateway.admin.nodes import ask, relay
from coderai.gateway.errors import ApiError
from coderai.gateway.http import json_response, read_json
from coderai.gateway.state import AdminController

PERIODS = ("hour", "day", "week", "month")
NO_BROKER = (
    "no pod broker is running: `coderai up` starts one only when given a RunPod API key (--runpod-key-file, "
    "or RUNPOD_API_KEY); on a cluster run `coderai pod-broker` on the head"
)


class _Lease(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    pods: int
    ttl: float


class PodsController(AdminController):
    @get("/pods")
    async def pods(self) -> Response:
        """Rented pods with their state and live cost, and what the ledger holds in all; with pods off, why; while
        RunPod's API fails, since when (`outage`)."""
        try:
            status = await ask(self.gw, CMD_BROKER_STATUS, BrokerStatusRequest())
        except ApiError as err:
            if err.code == "no_engine" and self.gw.bus.connected:  # connected, and nobody serves the subject
                return json_response(
                    {"configured": False, "broker": False, "why": NO_BROKER, "pods": [], "spent_usd": 0.0, "outage": ""}
                )
            raise
        pods = [{f: getattr(p, f) for f in p.__struct_fields__} for p in status.pods]  # every field, defaults too
        return json_response(
            {
                "configured": status.configured,
                "broker": True,
                "why": status.why,
                "pods": pods,
                "spent_usd": status.spent_usd,
                "outage": status.outage,
            }
        )

    @post("/pods/lease", status_code=200)
    async def lease(self, request: Request) -> Response:
        """A warm floor: `{model, pods, ttl}` keeps that many pods up for ttl seconds, busy or not."""
        req = await read_json(request, _Lease)
        return await relay(self.gw, CMD_BROKER_LEASE, LeaseRequest(model=req.model, pods=req.pods, ttl_s=req.ttl))

    @get("/spend")
    async def spend(self, request: Request) -> Response:
        """Pod spend (booked) and reservations by model for `period` (hour, day, week, month; default day)."""
        period = request.query_params.get("period", "day")
        if period not in PERIODS:
            raise ApiError(400, "period is one of hour, day, week, month.", param="period")
        if self.gw.redis is None:
            raise ApiError(
                404, "No Redis is configured (CODERAI_GATEWAY_REDIS_URL): spend is not kept.", code="no_ledger"
            )
        money = PodMoney(self.gw.redis, prefix=self.gw.settings.pod_ledger_prefix)
        rows = []
        for m in sorted(self.gw.catalog.models.values(), key=lambda m: m.name):
            if m.pod.burst == "never":
                continue
            spent, held = await money.spend(m.name, period), await money.reserved(m.name, period)
            rows.append(
                {
                    "model": m.name,
                    "spent_usd": spent,
                    "reserved_usd": held,
                    "budget_usd": m.pod.budget_usd or None,
                    "budget_period": m.pod.period,
                }
            )
        return json_response(
            {
                "period": period,
                "models": rows,
                "total_usd": await money.spend(None, period),
                "ledger_total_usd": await money.ledger_total_usd(),
            }
        )
