"""Admin HTTP (admin-scoped keys only): nodes, a node's logs, drain, and model placement.

Each route is a thin bridge to one bus command; the scheduler and the workers own the state."""

from __future__ import annotations

import asyncio
import csv
import datetime
import hmac
import io
import urllib.request
from typing import Any, Literal

import msgspec
from litestar import Request, Response, get, post

from coderai.accounts.keys import KeyError_, KeyStore, public
from coderai.contracts import BusError
from coderai.contracts.admin import DrainRequest, NodeLogsRequest, NodesRequest, PlaceRequest
from coderai.contracts.pods import BrokerStatusRequest, LeaseRequest
from coderai.contracts.subjects import (
    CMD_BROKER_LEASE,
    CMD_BROKER_STATUS,
    CMD_NODE_DRAIN,
    CMD_NODE_LOGS,
    CMD_SCHEDULER_NODES,
    CMD_SCHEDULER_PLACE,
    check_token,
)
from coderai.gateway.errors import ApiError, from_bus
from coderai.accounts.usage import FIELDS as USAGE_FIELDS
from coderai.accounts.usage import read as read_usage

JSON = "application/json"


def admin_routes(gw: Any, caller) -> list:
    """Route handlers bound to the gateway state `gw`; `caller(request, scope)` authenticates."""

    async def reply_to(subject, msg, **params: str) -> Any:
        """A bus command's reply; its errors as the API's (a node that does not answer: 404)."""
        try:
            return await gw.bus.request(subject, msg, timeout=5.0, **params)
        except BusError as exc:
            if exc.code == "no_engine" and "node_id" in params:
                raise ApiError(404, f"node {params['node_id']!r} is not reachable", code="node_not_found") from None
            raise from_bus(exc, gw.settings.retry_after_s) from None

    async def ask(subject, msg, **params: str) -> Response:
        reply = await reply_to(subject, msg, **params)
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
        await caller(request, "admin")
        return await ask(CMD_SCHEDULER_NODES, NodesRequest())

    @get("/admin/splits")
    async def splits(request: Request) -> Response:
        """Models split over several nodes: per device, its node, endpoint, share and the layers it holds."""
        await caller(request, "admin")
        reply = await reply_to(CMD_SCHEDULER_NODES, NodesRequest())
        engine_warnings = {(n.heartbeat.node_id, e.model): e.warning for n in reply.nodes for e in n.heartbeat.engines}

        def warning(name: str, p: Any) -> str:  # the plan's (configured link) and the engine's (measured link)
            return "; ".join(w for w in (p.warning, engine_warnings.get((p.devices[0].node_id, name), "")) if w)

        data = [{"model": name, "serving_node": p.devices[0].node_id, "mode": p.mode, "n_layers": p.n_layers,
                 "warning": warning(name, p), "devices": [{"node_id": d.node_id, "endpoint": d.endpoint, "share": d.share,
                                                    "layers": d.layers} for d in p.devices]}
                for name, p in sorted(reply.splits.items())]
        return json({"object": "list", "data": data})

    @get("/admin/nodes/{nid:str}/logs")
    async def logs(request: Request) -> Response:

        nid = request.path_params["nid"]
        await caller(request, "admin")
        try:
            lines = int(request.query_params.get("lines", "200"))
        except ValueError:
            raise ApiError(400, "lines must be an integer", param="lines") from None
        return await ask(CMD_NODE_LOGS, NodeLogsRequest(lines=max(1, min(lines, 2000))), node_id=node_id(nid))

    @post("/admin/nodes/{nid:str}/drain", status_code=200)
    async def drain(request: Request) -> Response:

        nid = request.path_params["nid"]
        await caller(request, "admin")
        return await ask(CMD_NODE_DRAIN, body(await request.body(), DrainRequest), node_id=node_id(nid))

    class _Target(msgspec.Struct, forbid_unknown_fields=True):
        node: str

    async def placement(request: Request, model: str, action: str) -> Response:
        await caller(request, "admin")
        target = body(await request.body(), _Target)
        return await ask(CMD_SCHEDULER_PLACE, PlaceRequest(model=model, node=target.node, action=action))  # type: ignore[arg-type]

    @post("/admin/models/{model:str}/place", status_code=200)
    async def place(request: Request) -> Response:

        model = request.path_params["model"]
        return await placement(request, model, "place")

    @post("/admin/models/{model:str}/unplace", status_code=200)
    async def unplace(request: Request) -> Response:

        model = request.path_params["model"]
        return await placement(request, model, "unplace")

    # --- keys and usage (Redis) ---------------------------------------------------------------------

    def store() -> KeyStore:
        if gw.redis is None:
            raise ApiError(503, "API keys and usage need Redis: set CODERAI_GATEWAY_REDIS_URL.", type="service_unavailable",
                           code="no_redis")
        return KeyStore(gw.redis)

    class _NewKey(msgspec.Struct, forbid_unknown_fields=True):
        name: str
        scopes: list[str] = msgspec.field(default_factory=lambda: ["inference"])
        models: list[str] = []
        rpm: int = 0
        tpm: int = 0
        budget_usd: float = 0.0
        budget_period: Literal["hour", "day", "week", "month"] = "month"

    class _Limits(msgspec.Struct, forbid_unknown_fields=True):
        models: list[str] | None = None
        rpm: int | None = None
        tpm: int | None = None
        budget_usd: float | None = None
        budget_period: Literal["hour", "day", "week", "month"] | None = None

    def json(obj: Any, status: int = 200) -> Response:
        return Response(content=msgspec.json.encode(obj), media_type=JSON, status_code=status)

    @post("/admin/keys", status_code=201)
    async def create_key(request: Request) -> Response:
        await caller(request, "admin")
        spec = body(await request.body(), _NewKey)
        try:
            secret, rec = await store().create(spec.name, spec.scopes, models=spec.models, rpm=spec.rpm, tpm=spec.tpm,
                                               budget_usd=spec.budget_usd, budget_period=spec.budget_period)
        except KeyError_ as exc:
            raise ApiError(409 if "exists" in str(exc) else 400, str(exc), code="key_conflict") from None
        return json({"key": secret, **public(rec), "note": "shown once: store it now"}, 201)

    @get("/admin/keys")
    async def list_keys(request: Request) -> Response:
        await caller(request, "admin")
        return json({"keys": [public(k) for k in await store().list()]})

    async def _change(name: str, fn) -> Response:
        try:
            return json(public(await fn(name)))
        except KeyError_ as exc:
            raise ApiError(404, str(exc), code="key_not_found") from None

    @post("/admin/keys/{name:str}/revoke", status_code=200)
    async def revoke_key(request: Request) -> Response:

        name = request.path_params["name"]
        await caller(request, "admin")
        return await _change(name, store().revoke)

    @post("/admin/keys/{name:str}/limits", status_code=200)
    async def limit_key(request: Request) -> Response:

        name = request.path_params["name"]
        await caller(request, "admin")
        changes = {k: v for k, v in msgspec.structs.asdict(body(await request.body(), _Limits)).items() if v is not None}
        return await _change(name, lambda n: store().update(n, **changes))

    @get("/admin/usage")
    async def usage_rows(request: Request) -> Response:
        """Usage per key x model x day; `from`/`to` (YYYY-MM-DD, default today), `key`, `model`, `format=csv`."""
        await caller(request, "admin")
        q = request.query_params
        try:
            days = day_range(q.get("from"), q.get("to"))
        except ValueError as exc:
            raise ApiError(400, str(exc), param="from") from None
        rows = await read_usage(store().redis, days, key=q.get("key", ""), model=q.get("model", ""))
        if q.get("format") == "csv":
            out = io.StringIO()
            w = csv.DictWriter(out, fieldnames=["day", "key", "model", *USAGE_FIELDS[:-1], "cost_usd"])
            w.writeheader()
            w.writerows(rows)
            return Response(content=out.getvalue(), media_type="text/csv",
                            headers={"Content-Disposition": 'attachment; filename="coderai-usage.csv"'})
        return json({"rows": rows})

    @get("/admin/pods")
    async def pods(request: Request) -> Response:
        """Rented pods with their state and live cost, and what the ledger holds in all."""
        await caller(request, "admin")
        status = await reply_to(CMD_BROKER_STATUS, BrokerStatusRequest())
        pods = [{f: getattr(p, f) for f in p.__struct_fields__} for p in status.pods]  # every field, defaults too
        return json({"configured": status.configured, "pods": pods, "spent_usd": status.spent_usd})

    @post("/admin/pods/lease", status_code=200)
    async def lease(request: Request) -> Response:
        """A warm floor: `{model, pods, ttl}` keeps that many pods up for ttl seconds, busy or not."""
        await caller(request, "admin")
        req = body(await request.body(), _Lease)
        return await ask(CMD_BROKER_LEASE, LeaseRequest(model=req.model, pods=req.pods, ttl_s=req.ttl))

    @get("/admin/spend")
    async def spend(request: Request) -> Response:
        """Pod spend (booked) and reservations by model for `period` (hour, day, week, month; default day)."""
        await caller(request, "admin")
        period = request.query_params.get("period", "day")
        if period not in ("hour", "day", "week", "month"):
            raise ApiError(400, "period is one of hour, day, week, month.", param="period")
        if gw.redis is None:
            raise ApiError(404, "No Redis is configured (CODERAI_GATEWAY_REDIS_URL): spend is not kept.", code="no_ledger")
        from coderai.accounts.pod_money import PodMoney

        money = PodMoney(gw.redis, prefix=gw.settings.pod_ledger_prefix)
        rows = []
        for m in sorted(gw.catalog.models.values(), key=lambda m: m.name):
            if m.pod.burst == "never":
                continue
            spent, held = await money.spend(m.name, period), await money.reserved(m.name, period)
            rows.append({"model": m.name, "spent_usd": spent, "reserved_usd": held,
                         "budget_usd": m.pod.budget_usd or None, "budget_period": m.pod.period})
        return json({"period": period, "models": rows, "total_usd": await money.spend(None, period),
                     "ledger_total_usd": await money.ledger_total_usd()})

    @get("/metrics")
    async def metrics(request: Request) -> Response:
        """The metrics service's Prometheus text, for an admin key or the scrape token."""
        token = gw.settings.scrape_token
        given = request.headers.get("authorization", "")
        if not (token and hmac.compare_digest(given.encode(), f"Bearer {token}".encode())):
            await caller(request, "admin")
        url = gw.settings.metrics_url
        if not url:
            raise ApiError(404, "No metrics service is configured (CODERAI_GATEWAY_METRICS_URL).", code="no_metrics")

        def fetch() -> bytes:
            req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.read()

        try:
            text = await asyncio.to_thread(fetch)
        except OSError as exc:
            raise ApiError(502, f"The metrics service did not answer: {exc}", type="engine_error", code="metrics_unavailable") from None
        return Response(content=text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return [nodes, splits, logs, drain, place, unplace, create_key, list_keys, revoke_key, limit_key, usage_rows, pods, lease,
            spend, metrics]


class _Lease(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    pods: int
    ttl: float


def day_range(start: str | None, end: str | None, max_days: int = 366) -> list[str]:
    """Every UTC day from `start` to `end` inclusive (YYYY-MM-DD; default today)."""
    today = datetime.datetime.now(datetime.timezone.utc).date()
    a = datetime.date.fromisoformat(start) if start else today
    b = datetime.date.fromisoformat(end) if end else (a if start else today)
    if b < a:
        raise ValueError("`to` is before `from`")
    n = (b - a).days + 1
    if n > max_days:
        raise ValueError(f"at most {max_days} days at once")
    return [(a + datetime.timedelta(days=i)).isoformat() for i in range(n)]
