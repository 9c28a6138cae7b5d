"""Bearer API keys, checked against SHA-256 hashes from the keys file (`coderai.accounts.keyfile`; keys are never
stored in clear) and then in Redis, and the guards that admit a controller's callers."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from litestar import Request
from litestar.types import Scope
from redis.exceptions import RedisError

from coderai.accounts.keyfile import KeyRecord, hash_key
from coderai.accounts.keys import ApiKey, KeyStore, reserved_name
from coderai.gateway.errors import ApiError
from coderai.gateway.http import client_request_id, client_request_id_var, priority_var, request_priority


@dataclass(frozen=True)
class Caller:
    key_name: str
    scopes: frozenset[str]
    key: ApiKey | None = None  # a Redis key, with its model allow-list, limits and budget


ANONYMOUS = Caller("anonymous", frozenset({"inference", "admin"}))

log = logging.getLogger("coderai.gateway")

# A key Redis answered for this recently is let in as it was then while Redis does not answer within
# STORE_WAIT_S (its master died and the sentinels are promoting a replica: seconds): a failover is not a client's
# outage. Redis is still asked first on every request, so a revoked key is refused as soon as Redis answers.
KNOWN_S = 60.0
STORE_WAIT_S = 1.0
KNOWN_MAX = 10_000  # keys remembered: past it, the one read longest ago is forgotten


class Authenticator:
    """Keys from the keys file (the bootstrap admin key of `coderai up`), then keys in Redis (`coderai keys`)."""

    def __init__(self, keys: dict[str, KeyRecord] | None, store: KeyStore | None = None) -> None:
        self.keys = keys  # None: auth is off
        self.store = store
        self.file_names = frozenset(r.name for r in (keys or {}).values())
        self._known: dict[str, tuple[ApiKey, float]] = {}  # digest -> (its record, when Redis last said so)
        self._stale_said = False

    async def check(self, authorization: str | None, scope: str = "inference") -> Caller:
        if self.keys is None:
            return ANONYMOUS
        if not authorization or not authorization.lower().startswith("bearer "):
            raise ApiError(
                401,
                "Missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>').",
                code="invalid_api_key",
            )
        digest = hash_key(authorization[7:].strip())
        rec = self.keys.get(digest)  # a lookup by digest leaks nothing useful about the key itself
        if rec is not None:
            caller = Caller(rec.name, frozenset(rec.scopes))
        else:
            stored = await self._stored(digest) if self.store is not None else None
            if stored is None or stored.revoked:
                raise ApiError(
                    401,
                    "Incorrect API key provided." if stored is None else "This API key has been revoked.",
                    code="invalid_api_key",
                )
            if reserved_name(stored.name, self.file_names):  # made before names were reserved: never the admin's
                log.warning("refused key %r from the key store: its name is a bootstrap key's", stored.name)
                raise ApiError(401, "This API key's name is reserved; ask for a new key.", code="invalid_api_key")
            caller = Caller(stored.name, frozenset(stored.scopes), stored)
        if scope not in caller.scopes:
            raise ApiError(403, f"This key lacks the '{scope}' scope.", code="forbidden")
        return caller

    async def revoked(self, who: Caller) -> bool:
        """Whether `who`'s key was revoked (or deleted) since it was let in: what it started that outlives its
        request (a batch, a background response, a video) then stops. A keys-file key, or no auth: never. A key
        store that does not answer counts as "not revoked": it is asked again at the next check."""
        if who.key is None or self.store is None:
            return False
        try:
            stored = await self.store.get(who.key.sha256)
        except Exception:  # the key store blinked
            return False
        return stored is None or stored.revoked

    async def revoked_name(self, name: str) -> bool:
        """`revoked` for work that kept only its key's name (a fine-tuning job)."""
        if self.keys is None or self.store is None or name in self.file_names or not name:
            return False
        try:
            stored = await self.store.by_name(name)
        except Exception:  # the key store blinked
            return False
        return stored is None or stored.revoked

    async def _stored(self, digest: str) -> ApiKey | None:
        """The key's record in Redis; the one Redis gave within `KNOWN_S` while Redis does not answer in time."""
        assert self.store is not None
        known = self._known.get(digest)
        if known is not None and time.monotonic() - known[1] > KNOWN_S:
            known = None
        try:
            if known is None:  # never seen (or long ago): only Redis can say, however long it takes
                stored = await self.store.get(digest)
            else:
                async with asyncio.timeout(STORE_WAIT_S):
                    stored = await self.store.get(digest)
        except (OSError, RedisError) as exc:  # TimeoutError is an OSError
            if known is not None:
                if not self._stale_said:
                    self._stale_said = True
                    log.warning(
                        "the key store does not answer (%s); keys it answered for in the last %.0f s are "
                        "let in as they were",
                        exc or type(exc).__name__,
                        KNOWN_S,
                    )
                return known[0]
            raise ApiError(
                503,
                f"The key store is unavailable: {exc or type(exc).__name__}",
                type="service_unavailable",
                code="key_store_unavailable",
                headers={"Retry-After": "5"},
            ) from None
        self._stale_said = False
        self._known.pop(digest, None)
        if stored is not None and not stored.revoked:
            self._known[digest] = (stored, time.monotonic())
            if len(self._known) > KNOWN_MAX:
                self._known.pop(next(iter(self._known)))
        return stored


# --- guards: every controller declares one; the caller it admits is the `who` its handlers are given -------------
#
# A guard is the controller's `before_request` hook, not a litestar guard or middleware: litestar copies the route
# handler for every guard it runs, and wraps a route with middleware in a second exception layer that every send
# goes through, each of which costs the hot path more than the key check itself.

CALLER = "coderai.caller"  # where a guard leaves the caller, in the request's ASGI state


def _authorization(scope: Scope) -> str | None:
    """The `Authorization` header; else an `x-api-key` (the Anthropic SDK's) as its Bearer key. One scan."""
    api_key = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value.decode("latin-1")
        if name == b"x-api-key":
            api_key = value
    return None if api_key is None else "Bearer " + api_key.decode("latin-1")


def _guard(needed: str) -> Callable[[Request], Awaitable[None]]:
    async def guard(request: Request) -> None:
        scope = request.scope
        auth: Authenticator = scope["litestar_app"].state.gateway.auth
        scope["state"][CALLER] = await auth.check(_authorization(scope), needed)
        client_request_id_var.set(client_request_id(scope))  # set on every request: a kept-alive task may serve many
        priority_var.set(request_priority(scope))

    guard.__name__ = f"{needed}_guard"
    return guard


inference_guard = _guard("inference")
admin_guard = _guard("admin")


async def scrape_guard(request: Request) -> None:
    """`/metrics`: the scrape token (CODERAI_GATEWAY_SCRAPE_TOKEN) or an admin key."""
    scope = request.scope
    token = scope["litestar_app"].state.gateway.settings.scrape_token
    given = _authorization(scope) or ""
    if token and hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        scope["state"][CALLER] = Caller("scraper", frozenset())
        return
    await admin_guard(request)
