"""Bearer keys: checked by SHA-256 digest and scoped (the keys file itself: tests/accounts/test_keyfile.py)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from coderai.gateway import auth as gateway_auth

from coderai.accounts.keyfile import KeyRecord, hash_key
from coderai.gateway.auth import ANONYMOUS, Authenticator, Caller
from coderai.gateway.errors import ApiError

KEY = "sk-coderai-right"
ADMIN_KEY = "sk-coderai-admin"


@pytest.fixture
def auth() -> Authenticator:
    recs = [KeyRecord("alice", hash_key(KEY)), KeyRecord("root", hash_key(ADMIN_KEY), ["inference", "admin"])]
    return Authenticator({r.sha256: r for r in recs})


async def denied(auth: Authenticator, header: str | None, scope: str = "inference") -> ApiError:
    with pytest.raises(ApiError) as ei:
        await auth.check(header, scope)
    return ei.value


async def test_no_keys_means_everyone_is_anonymous_with_every_scope():
    a = Authenticator(None)
    assert await a.check(None) is ANONYMOUS
    assert await a.check("Bearer whatever", "admin") is ANONYMOUS
    assert ANONYMOUS == Caller("anonymous", frozenset({"inference", "admin"}))


async def test_an_empty_key_table_still_requires_a_key():
    err = await denied(Authenticator({}), "Bearer " + KEY)
    assert (err.status, err.code) == (401, "invalid_api_key")


@pytest.mark.parametrize("header", [None, "", "Basic abc", "Bearer", "sk-coderai-right", "Token " + KEY])
async def test_a_missing_or_non_bearer_header_is_401(auth, header):
    err = await denied(auth, header)
    assert (err.status, err.code, err.type) == (401, "invalid_api_key", "invalid_request_error")
    assert "Missing API key" in err.message


@pytest.mark.parametrize(
    "header", ["Bearer sk-coderai-wrong", "Bearer ", "Bearer " + KEY.upper(), "Bearer " + KEY + "x"]
)
async def test_a_wrong_key_is_401(auth, header):
    err = await denied(auth, header)
    assert (err.status, err.code) == (401, "invalid_api_key")
    assert "Incorrect API key" in err.message


@pytest.mark.parametrize("header", ["Bearer " + KEY, "bearer " + KEY, "BEARER " + KEY, "Bearer   " + KEY + "  "])
async def test_the_right_key_returns_its_caller(auth, header):
    assert await auth.check(header) == Caller("alice", frozenset({"inference"}))


async def test_a_key_without_the_scope_is_403(auth):
    err = await denied(auth, "Bearer " + KEY, "admin")
    assert (err.status, err.code) == (403, "forbidden")
    assert "'admin'" in err.message


async def test_a_key_with_the_scope_passes(auth):
    assert await auth.check("Bearer " + ADMIN_KEY, "admin") == Caller("root", frozenset({"inference", "admin"}))
    assert (await auth.check("Bearer " + ADMIN_KEY)).key_name == "root"


# --- keys in Redis while Redis fails over -------------------------------------------------------------------------


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test's own: it is stopped (SIGSTOP) as a master that died without closing is."""
    from coderai.runtime.embedded_redis import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    yield server
    if server.proc is not None:
        server.proc.send_signal(signal.SIGCONT)
    server.stop()


@pytest.fixture
async def stored(own_redis, monkeypatch):
    """(an Authenticator over a KeyStore in `own_redis`, its store, a key's secret, the redis-server)."""
    from coderai.accounts.keys import KeyStore
    from coderai.runtime.redis_client import connect

    monkeypatch.setattr(gateway_auth, "STORE_WAIT_S", 0.3)

    r = connect(own_redis.url)
    store = KeyStore(r)
    secret, _ = await store.create("bob", ["inference"])
    yield Authenticator({}, store), store, secret, own_redis
    await r.aclose()


async def test_a_key_redis_answered_for_lately_is_let_in_while_redis_does_not_answer(stored):
    auth, store, secret, server = stored
    assert (await auth.check("Bearer " + secret)).key_name == "bob"
    server.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        who = await auth.check("Bearer " + secret)  # waits STORE_WAIT_S for Redis, then goes by what it said
        assert who.key_name == "bob" and who.key is not None and time.monotonic() - t0 < 10
    finally:
        server.proc.send_signal(signal.SIGCONT)


async def test_a_key_never_seen_waits_for_redis_and_is_never_let_in_unchecked(stored):
    auth, store, secret, server = stored
    server.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError):  # still waiting on Redis: neither let in nor refused as wrong
            await asyncio.wait_for(auth.check("Bearer " + secret), gateway_auth.STORE_WAIT_S * 3)
    finally:
        server.proc.send_signal(signal.SIGCONT)
    assert (await auth.check("Bearer " + secret)).key_name == "bob"


async def test_a_key_seen_long_ago_is_not_let_in_on_memory(stored):
    auth, store, secret, server = stored
    await auth.check("Bearer " + secret)
    digest = hash_key(secret)
    rec, _ = auth._known[digest]
    auth._known[digest] = (rec, time.monotonic() - gateway_auth.KNOWN_S - 1)
    server.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(auth.check("Bearer " + secret), gateway_auth.STORE_WAIT_S * 3)
    finally:
        server.proc.send_signal(signal.SIGCONT)


async def test_a_revoked_key_is_refused_at_once_and_forgotten(stored):
    """The attack: a key revoked while it was remembered must not ride on the memory when Redis stalls next."""
    auth, store, secret, server = stored
    await auth.check("Bearer " + secret)
    await store.revoke("bob")
    err = await denied(auth, "Bearer " + secret)
    assert (err.status, err.code) == (401, "invalid_api_key") and "revoked" in err.message
    server.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError):  # nothing remembered: it waits for Redis, as an unknown key does
            await asyncio.wait_for(auth.check("Bearer " + secret), gateway_auth.STORE_WAIT_S * 3)
    finally:
        server.proc.send_signal(signal.SIGCONT)
    assert (await denied(auth, "Bearer " + secret)).status == 401


async def test_a_key_may_not_take_a_bootstrap_keys_name(stored):
    """Attack: an operator (or a script with an admin key) makes an inference key named `admin`: the files,
    responses and batches of the bootstrap admin are owned by that name. Every bootstrap name is refused, and a key
    made under one before names were reserved is refused at the door."""
    from coderai.accounts.keys import ApiKey, KeyError_, KeyStore, digest

    auth, store, _, _ = stored
    head_file = {hash_key("sk-file"): KeyRecord(name="ops", sha256=hash_key("sk-file"), scopes=["inference", "admin"])}
    guarded = KeyStore(store.redis, taken=frozenset({"ops"}))
    for name in ("admin", "admin-1a2b3c", "anonymous", "ops"):
        with pytest.raises(KeyError_, match="reserved"):
            await guarded.create(name, ["inference"])
        print(f"tried to create a key named {name!r}: refused")
    # one made before the rule (written into Redis as an old gateway would have): refused when it is used
    old = ApiKey(name="ops", sha256=digest("sk-old-ops"), scopes=["inference"])
    await store._to_redis(old)
    with pytest.raises(ApiError) as exc:
        await Authenticator(head_file, store).check("Bearer sk-old-ops")
    assert exc.value.status == 401
    assert (await Authenticator(head_file, store).check("Bearer sk-file")).key_name == "ops"
