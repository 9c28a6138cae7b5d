"""API keys in Redis: stored by SHA-256 of the key (the key itself is shown once, at creation, and never stored).

    coderai:key:<sha256>   hash: name, scopes, models, rpm, tpm, budget_usd, budget_period, created, revoked
    coderai:keyname:<name> string: <sha256> (names are unique)

Gateways read the record on every request that presents such a key (one round trip on loopback, ~0.1 ms) and
cache nothing, so a revocation is refused by every replica from the next request on.

With a journal (`KeyJournal`: the replicated `coderai_keys` bucket), every change is written there first, then
to Redis; a key Redis does not hold (it was replaced or emptied) is looked up in the journal and put back, so
keys and their revocations outlive Redis.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Mapping
from typing import Any, Literal, cast

import msgspec

Period = Literal["hour", "day", "week", "month"]
log = logging.getLogger("coderai.accounts")


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
    # output tokens of one of its requests, beside the model's own limits: its default when a request names none,
    # and its ceiling (the lower of the key's and the model's applies); 0: the model's alone
    default_output_tokens: int = 0
    max_output_tokens: int = 0
    # whether its requests share the engines' prompt caches with other keys (ModelConfig.share_cache); None: the
    # model's word, else the gateway's default
    share_cache: bool | None = None


# Names a key in Redis may not take: the bootstrap keys' (`coderai up` writes "admin" into keys.toml, and each head
# that joins by invite "admin-<hex>"), and the caller of a gateway without auth. Files, responses and batches are
# owned by key name, so a tenant's key named "admin" would own the admin's.
RESERVED_NAMES = frozenset({"admin", "anonymous"})
RESERVED_PREFIX = "admin-"


def reserved_name(name: str, taken: frozenset[str] = frozenset()) -> bool:
    """Whether a key in Redis may not be named `name` (`taken`: the names in this gateway's keys file)."""
    return name in RESERVED_NAMES or name.startswith(RESERVED_PREFIX) or name in taken


class KeyError_(Exception):
    """A key operation that cannot be done (duplicate name, unknown key)."""


def new_secret() -> str:
    return "sk-coderai-" + secrets.token_urlsafe(32)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _to_hash(k: ApiKey) -> dict[str, str]:
    return {
        "name": k.name,
        "sha256": k.sha256,
        "scopes": ",".join(k.scopes),
        "models": ",".join(k.models),
        "rpm": str(k.rpm),
        "tpm": str(k.tpm),
        "budget_usd": repr(k.budget_usd),
        "budget_period": k.budget_period,
        "created": repr(k.created),
        "revoked": "1" if k.revoked else "0",
        "default_output_tokens": str(k.default_output_tokens),
        "max_output_tokens": str(k.max_output_tokens),
        "share_cache": "" if k.share_cache is None else "1" if k.share_cache else "0",
    }


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _split(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def _from_hash(h: Mapping[bytes | str, bytes | str]) -> ApiKey:
    d = {_text(k): _text(v) for k, v in h.items()}
    return ApiKey(
        name=d["name"],
        sha256=d["sha256"],
        scopes=_split(d.get("scopes", "")),
        models=_split(d.get("models", "")),
        rpm=int(d.get("rpm", 0)),
        tpm=int(d.get("tpm", 0)),
        budget_usd=float(d.get("budget_usd", 0)),
        budget_period=cast(Period, d.get("budget_period", "month")),  # _to_hash wrote an ApiKey's own period
        created=float(d.get("created", 0)),
        revoked=d.get("revoked") == "1",
        default_output_tokens=int(d.get("default_output_tokens", 0)),
        max_output_tokens=int(d.get("max_output_tokens", 0)),
        share_cache={"1": True, "0": False}.get(d.get("share_cache", "")),
    )


class KeyJournal:
    """Every key record in the `coderai_keys` bucket (by SHA-256, like Redis: never the key), on `bus`."""

    def __init__(self, bus: Any) -> None:
        self.bus = bus

    async def _kv(self) -> Any:
        from coderai.contracts.topology import KEYS

        return await self.bus.kv(KEYS)

    async def put(self, rec: ApiKey) -> None:
        kv = await self._kv()
        await kv.put(rec.sha256, msgspec.json.encode(rec))
        await kv.put(_name_key(rec.name), rec.sha256.encode())  # by name too: one lookup, not a scan of every key

    async def by_name(self, name: str) -> ApiKey | None:
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await (await self._kv()).get(_name_key(name))
        except KeyNotFoundError:
            return None
        return await self.get(entry.value.decode()) if entry.value else None

    async def get(self, sha256: str) -> ApiKey | None:
        from nats.js.errors import KeyNotFoundError

        if not sha256 or any(c not in "0123456789abcdef" for c in sha256):  # not a digest: no KV key to look up
            return None
        try:
            entry = await (await self._kv()).get(sha256)
        except KeyNotFoundError:
            return None
        return msgspec.json.decode(entry.value, type=ApiKey) if entry.value else None

    async def all(self) -> list[ApiKey]:
        from nats.js.errors import NoKeysError

        try:
            names = await (await self._kv()).keys()
        except NoKeysError:
            return []
        return [rec for sha in names if not sha.startswith(NAME_PREFIX) and (rec := await self.get(sha)) is not None]


NAME_PREFIX = "name."


def _name_key(name: str) -> str:
    """A key name as a KV key (hex: a name may hold characters a KV key may not)."""
    return NAME_PREFIX + name.encode().hex()


class KeyStore:
    """CRUD over the Redis layout above; `redis` is a redis.asyncio client; `journal` (optional) keeps every
    record beyond Redis."""

    def __init__(self, redis: Any, journal: KeyJournal | None = None, taken: frozenset[str] = frozenset()) -> None:
        self.redis = redis
        self.journal = journal
        self.taken = taken  # the keys file's names: reserved too

    async def _keep(self, rec: ApiKey) -> None:
        """`rec` to the journal, then to Redis: a change acknowledged is one a lost Redis gets back."""
        if self.journal is not None:
            await self.journal.put(rec)
        await self._to_redis(rec)

    async def _to_redis(self, rec: ApiKey) -> None:
        await self.redis.set(f"coderai:keyname:{rec.name}", rec.sha256)
        await self.redis.hset(f"coderai:key:{rec.sha256}", mapping=_to_hash(rec))

    async def create(self, name: str, scopes: list[str], **limits: Any) -> tuple[str, ApiKey]:
        """A new key: returns (the secret, shown once; the stored record)."""
        if not name or any(c in name for c in " \t\n:"):
            raise KeyError_(f"bad key name {name!r}: no spaces or colons")
        if reserved_name(name, self.taken):
            raise KeyError_(f"the key name {name!r} is reserved (admin, admin-*, anonymous and the keys file's names)")
        bad = set(scopes) - {"inference", "admin"}
        if bad or not scopes:
            raise KeyError_(f"scopes must be inference and/or admin, not {sorted(bad) or scopes}")
        secret = new_secret()
        rec = ApiKey(name=name, sha256=digest(secret), scopes=scopes, created=time.time(), **limits)
        if await self.by_name(name) is not None or not await self.redis.set(
            f"coderai:keyname:{name}", rec.sha256, nx=True
        ):
            raise KeyError_(f"a key named {name!r} exists")
        try:
            await self._keep(rec)
        except BaseException:  # not kept (the journal unreachable): the name is free again
            await self.redis.delete(f"coderai:keyname:{name}")
            raise
        return secret, rec

    async def get(self, sha256: str) -> ApiKey | None:
        h = await self.redis.hgetall(f"coderai:key:{sha256}")
        if h:
            return _from_hash(h)
        rec = None
        if self.journal is not None:
            try:
                rec = await self.journal.get(sha256)
            except Exception as exc:  # the bus away: an unknown key stays unknown (a 401, not a 503)
                log.debug("key journal not read: %s", exc)
        if rec is not None:  # Redis lost it: put it back for every gateway
            await self._to_redis(rec)
        return rec

    async def by_name(self, name: str) -> ApiKey | None:
        sha = await self.redis.get(f"coderai:keyname:{name}")
        if sha:
            return await self.get(sha.decode() if isinstance(sha, bytes) else sha)
        rec = await self.journal.by_name(name) if self.journal is not None else None
        return await self.get(rec.sha256) if rec is not None else None

    async def list(self) -> list[ApiKey]:
        out: dict[str, ApiKey] = {}
        async for k in self.redis.scan_iter(match="coderai:key:*", count=500):
            rec = await self.get((k.decode() if isinstance(k, bytes) else k).rsplit(":", 1)[1])
            if rec is not None:
                out[rec.sha256] = rec
        if self.journal is not None:
            for rec in await self.journal.all():
                if rec.sha256 not in out:
                    out[rec.sha256] = await self.get(rec.sha256) or rec
        return sorted(out.values(), key=lambda r: r.name)

    async def revoke(self, name: str) -> ApiKey:
        rec = await self.by_name(name)
        if rec is None:
            raise KeyError_(f"no key named {name!r}")
        new = msgspec.structs.replace(rec, revoked=True)
        await self._keep(new)
        return new

    async def update(self, name: str, **changes: Any) -> ApiKey:
        rec = await self.by_name(name)
        if rec is None:
            raise KeyError_(f"no key named {name!r}")
        new = msgspec.structs.replace(rec, **changes)
        await self._keep(new)
        return new


def public(k: ApiKey) -> dict[str, Any]:
    """What the admin API shows of a key: everything but the digest."""
    d = msgspec.to_builtins(k)
    d.pop("sha256")
    return d
