"""Bearer keys: checked by SHA-256 digest and scoped (the keys file itself: tests/accounts/test_keyfile.py)."""

from __future__ import annotations


import pytest

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


@pytest.mark.parametrize("header", ["Bearer sk-coderai-wrong", "Bearer ", "Bearer " + KEY.upper(), "Bearer " + KEY + "x"])
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
