"""Admin HTTP for API keys and usage (admin keys only; both live in Redis): create, list, revoke and limit keys,
and usage per key x model x day (JSON or CSV)."""

from __future__ import annotations

import csv
import datetime
import io
from collections.abc import Awaitable, Callable
from typing import Annotated, Literal

import msgspec
from litestar import Request, Response, get, post
from litestar.params import FromPath

from coderai.accounts.keys import ApiKey, KeyError_, KeyJournal, KeyStore, public
from coderai.accounts.usage import FIELDS as USAGE_FIELDS
from coderai.accounts.usage import read as read_usage
from coderai.gateway.errors import ApiError
from coderai.gateway.http import json_response, read_json
from coderai.gateway.state import AdminController, Gateway

Period = Literal["hour", "day", "week", "month"]


class _NewKey(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    scopes: list[str] = msgspec.field(default_factory=lambda: ["inference"])
    models: list[str] = []
    rpm: int = 0
    tpm: int = 0
    budget_usd: float = 0.0
    budget_period: Period = "month"
    default_output_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_output_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    share_cache: bool | None = None


class _Limits(msgspec.Struct, forbid_unknown_fields=True):
    models: list[str] | None = None
    rpm: int | None = None
    tpm: int | None = None
    budget_usd: float | None = None
    budget_period: Period | None = None
    default_output_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    share_cache: bool | None = None


def _store(gw: Gateway) -> KeyStore:
    if gw.redis is None:
        raise ApiError(
            503,
            "API keys and usage need Redis: set CODERAI_GATEWAY_REDIS_URL.",
            type="service_unavailable",
            code="no_redis",
        )
    return KeyStore(gw.redis, KeyJournal(gw.bus), taken=frozenset(r.name for r in (gw.auth.keys or {}).values()))


async def _change(name: str, fn: Callable[[str], Awaitable[ApiKey]]) -> Response:
    try:
        return json_response(public(await fn(name)))
    except KeyError_ as exc:
        raise ApiError(404, str(exc), code="key_not_found") from None


class KeysController(AdminController):
    @post("/keys", status_code=201)
    async def create_key(self, request: Request) -> Response:
        spec = await read_json(request, _NewKey)
        try:
            secret, rec = await _store(self.gw).create(
                spec.name,
                spec.scopes,
                models=spec.models,
                rpm=spec.rpm,
                tpm=spec.tpm,
                budget_usd=spec.budget_usd,
                budget_period=spec.budget_period,
                default_output_tokens=spec.default_output_tokens,
                max_output_tokens=spec.max_output_tokens,
                share_cache=spec.share_cache,
            )
        except KeyError_ as exc:
            raise ApiError(409 if "exists" in str(exc) else 400, str(exc), code="key_conflict") from None
        return json_response({"key": secret, **public(rec), "note": "shown once: store it now"}, 201)

    @get("/keys")
    async def list_keys(self) -> Response:
        return json_response({"keys": [public(k) for k in await _store(self.gw).list()]})

    @post("/keys/{name:str}/revoke", status_code=200)
    async def revoke_key(self, name: FromPath[str]) -> Response:
        return await _change(name, _store(self.gw).revoke)

    @post("/keys/{name:str}/limits", status_code=200)
    async def limit_key(self, request: Request, name: FromPath[str]) -> Response:
        limits = await read_json(request, _Limits, empty=b"{}")
        changes = {k: v for k, v in msgspec.structs.asdict(limits).items() if v is not None}
        store = _store(self.gw)
        return await _change(name, lambda n: store.update(n, **changes))

    @get("/usage")
    async def usage_rows(self, request: Request) -> Response:
        """Usage per key x model x day; `from`/`to` (YYYY-MM-DD, default today), `key`, `model`, `format=csv`."""
        q = request.query_params
        try:
            days = day_range(q.get("from"), q.get("to"))
        except DayError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        rows = await read_usage(_store(self.gw).redis, days, key=q.get("key", ""), model=q.get("model", ""))
        if q.get("format") == "csv":
            out = io.StringIO()
            w = csv.DictWriter(out, fieldnames=["day", "key", "model", *USAGE_FIELDS[:-1], "cost_usd"])
            w.writeheader()
            w.writerows(rows)
            return Response(
                content=out.getvalue(),
                media_type="text/csv",
                headers={"Content-Disposition": 'attachment; filename="coderai-usage.csv"'},
            )
        return json_response({"rows": rows})


class DayError(ValueError):
    """A bad `from`/`to`, naming which (`param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _day(value: str, param: str) -> datetime.date:
    try:
        return datetime.date.fromisoformat(value)
    except ValueError:
        raise DayError(f"`{param}` is not a date (YYYY-MM-DD): {value!r}", param) from None


def day_range(start: str | None, end: str | None, max_days: int = 366) -> list[str]:
    """Every UTC day from `start` to `end` inclusive (YYYY-MM-DD; default today)."""
    today = datetime.datetime.now(datetime.timezone.utc).date()
    a = _day(start, "from") if start else today
    b = _day(end, "to") if end else (a if start else today)
    if b < a:
        raise DayError("`to` is before `from`", "to")
    n = (b - a).days + 1
    if n > max_days:
        raise DayError(f"at most {max_days} days at once", "to")
    return [(a + datetime.timedelta(days=i)).isoformat() for i in range(n)]
