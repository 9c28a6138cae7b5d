"""Bearer API keys, checked against SHA-256 hashes from the keys file (`coderai.accounts.keyfile`; keys are never
stored in clear) and then in Redis, and the guards that admit a controller's callers."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.handlers import BaseRouteHandler
from redis.exceptions import RedisError

from coderai.accounts.keyfile import KeyRecord, hash_key
from coderai.accounts.keys import ApiKey, KeyStore
from coderai.gateway.errors import ApiError


@dataclass(frozen=True)
class Caller:
    key_name: str
    scopes: frozenset[str]
    key: ApiKey | None = None  # a Redis key, with its model allow-list, limits and budget


ANONYMOUS = Caller("anonymous", frozenset({"inference", "admin"}))


class Authenticator:
    """Keys from the keys file (the bootstrap admin key of `coderai up`), then keys in Redis (`coderai keys`)."""

    def __init__(self, keys: dict[str, KeyRecord] | None, store: KeyStore | None = None) -> None:
        self.keys = keys  # None: auth is off
        self.store = store

    async def check(self, authorization: str | None, scope: str = "inference") -> Caller:
        if self.keys is None:
            return ANONYMOUS
        if not authorization or not authorization.lower().startswith("bearer "):
            raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key")
        digest = hash_key(authorization[7:].strip())
        rec = self.keys.get(digest)  # a lookup by digest leaks nothing useful about the key itself
        if rec is not None:
            caller = Caller(rec.name, frozenset(rec.scopes))
        else:
            try:
                stored = await self.store.get(digest) if self.store is not None else None
            except (OSError, RedisError) as exc:  # Redis is down: that is not the caller's mistake
                raise ApiError(503, f"The key store is unavailable: {exc}", type="service_unavailable",
                               code="key_store_unavailable", headers={"Retry-After": "5"}) from None
            if stored is None or stored.revoked:
                raise ApiError(401, "Incorrect API key provided." if stored is None else "This API key has been revoked.",
                               code="invalid_api_key")
            caller = Caller(stored.name, frozenset(stored.scopes), stored)
        if scope not in caller.scopes:
            raise ApiError(403, f"This key lacks the '{scope}' scope.", code="forbidden")
        return caller


# --- guards: every controller declares one; the caller they admit is the `who` its handlers are given ---------


def _guard(scope: str):
    async def guard(connection: ASGIConnection, _handler: BaseRouteHandler) -> None:
        auth: Authenticator = connection.app.state.gateway.auth
        connection.state.caller = await auth.check(connection.headers.get("authorization"), scope)

    guard.__name__ = f"{scope}_guard"
    return guard


inference_guard = _guard("inference")
admin_guard = _guard("admin")


async def scrape_guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """`/metrics`: the scrape token (CODERAI_GATEWAY_SCRAPE_TOKEN) or an admin key."""
    token = connection.app.state.gateway.settings.scrape_token
    given = connection.headers.get("authorization", "")
    if token and hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        connection.state.caller = Caller("scraper", frozenset())
        return
    await admin_guard(connection, handler)


def provide_caller(request: Request) -> Caller:
    """The caller the controller's guard admitted."""
    return request.state.caller


CallerDep = NamedDependency[Caller]
"""How a handler asks for its caller: `who: CallerDep` (the one its controller's guard admitted)."""
