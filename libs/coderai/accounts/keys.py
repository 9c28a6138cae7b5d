"""API keys in Redis: stored by SHA-256 of the key (the key itself is shown once, at creation, and never stored).

    coderai:key:<sha256>   hash: name, scopes, models, rpm, tpm, budget_usd, budget_period, created, revoked
    coderai:keyname:<name> string: <sha256> (names are unique)

Gateways read the record on every request that presents such a key (one round trip on loopback, ~0.1 ms) and
cache nothing, so a revocation is refused by every replica from the next request on.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any, Literal

import msgspec

Period = Literal["hour", "day", "week", "month"]


class ApiKey(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    sha256: str
    scopes: list[str] = msgspec.field(default_factory=lambda: ["inference"])
    models: list[str] = []  # allow-list; empty: every model
    rpm: int = 0  # requests per minute; 0: unlimited
    tpm: int = 0  # tokens per minute; 0: unlimited
    budget_usd: float = 0.0  # per budget_period; 0: unlimited
    budget_period: Period = "month"
    created: float = 0.0
    revoked: bool = False


class KeyError_(Exception):
    """A key operation that cannot be done (duplicate name, unknown key)."""


def new_secret() -> str:
    return "sk-coderai-" + secrets.token_urlsafe(32)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _to_hash(k: ApiKey) -> dict[str, str]:
    return {
        "name": k.name, "sha256": k.sha256, "scopes": ",".join(k.scopes), "models": ",".join(k.models),
        "rpm": str(k.rpm), "tpm": str(k.tpm), "budget_usd": repr(k.budget_usd), "budget_period": k.budget_period,
        "created": repr(k.created), "revoked": "1" if k.revoked else "0",
    }


def _from_hash(h: dict[Any, Any]) -> ApiKey:
    d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in h.items()}
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    return ApiKey(
        name=d["name"], sha256=d["sha256"], scopes=split(d.get("scopes", "")), models=split(d.get("models", "")),
        rpm=int(d.get("rpm", 0)), tpm=int(d.get("tpm", 0)), budget_usd=float(d.get("budget_usd", 0)),
        budget_period=d.get("budget_period", "month"), created=float(d.get("created", 0)),  # type: ignore[arg-type]
        revoked=d.get("revoked") == "1",
    )


class KeyStore:
    """CRUD over the Redis layout above; `redis` is a redis.asyncio client."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis

    async def create(self, name: str, scopes: list[str], **limits: Any) -> tuple[str, ApiKey]:
        """A new key: returns (the secret, shown once; the stored record)."""
        if not name or any(c in name for c in " \t\n:"):
            raise KeyError_(f"bad key name {name!r}: no spaces or colons")
        bad = set(scopes) - {"inference", "admin"}
        if bad or not scopes:
            raise KeyError_(f"scopes must be inference and/or admin, not {sorted(bad) or scopes}")
        secret = new_secret()
        rec = ApiKey(name=name, sha256=digest(secret), scopes=scopes, created=time.time(), **limits)
        if not await self.redis.set(f"coderai:keyname:{name}", rec.sha256, nx=True):
            raise KeyError_(f"a key named {name!r} exists")
        await self.redis.hset(f"coderai:key:{rec.sha256}", mapping=_to_hash(rec))
        return secret, rec

    async def get(self, sha256: str) -> ApiKey | None:
        h = await self.redis.hgetall(f"coderai:key:{sha256}")
        return _from_hash(h) if h else None

    async def by_name(self, name: str) -> ApiKey | None:
        sha = await self.redis.get(f"coderai:keyname:{name}")
        return await self.get(sha.decode() if isinstance(sha, bytes) else sha) if sha else None

    async def list(self) -> list[ApiKey]:
        out = []
        async for k in self.redis.scan_iter(match="coderai:key:*", count=500):
            rec = await self.get((k.decode() if isinstance(k, bytes) else k).rsplit(":", 1)[1])
            if rec is not None:
                out.append(rec)
        return sorted(out, key=lambda r: r.name)

    async def revoke(self, name: str) -> ApiKey:
        rec = await self.by_name(name)
        if rec is None:
            raise KeyError_(f"no key named {name!r}")
        await self.redis.hset(f"coderai:key:{rec.sha256}", "revoked", "1")
        return msgspec.structs.replace(rec, revoked=True)

    async def update(self, name: str, **changes: Any) -> ApiKey:
        rec = await self.by_name(name)
        if rec is None:
            raise KeyError_(f"no key named {name!r}")
        new = msgspec.structs.replace(rec, **changes)
        await self.redis.hset(f"coderai:key:{rec.sha256}", mapping=_to_hash(new))
        return new


def public(k: ApiKey) -> dict[str, Any]:
    """What the admin API shows of a key: everything but the digest."""
    d = msgspec.to_builtins(k)
    d.pop("sha256")
    return d
