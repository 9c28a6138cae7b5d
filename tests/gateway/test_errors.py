"""One table maps bus error codes to HTTP; every API error has the OpenAI JSON shape."""

from __future__ import annotations

import typing

import msgspec
import pytest

from coderai.contracts import BusError, ErrorCode
from coderai.gateway.errors import BUS_TO_HTTP, HTTP_TYPES, ApiError, from_bus, from_http


def test_every_bus_code_has_a_mapping():
    assert set(BUS_TO_HTTP) == set(typing.get_args(ErrorCode))


@pytest.mark.parametrize("code", sorted(BUS_TO_HTTP))
def test_from_bus_follows_the_table(code):
    err = from_bus(BusError(code, f"details for {code}", retryable=True), retry_after_s=7)
    status, type_ = BUS_TO_HTTP[code]
    assert (err.status, err.type, err.code, err.message, err.param) == (
        status,
        type_,
        code,
        f"details for {code}",
        None,
    )
    if status == 503 or code == "busy":
        assert err.headers == {"Retry-After": "7"}
    else:
        assert err.headers == {}


def test_the_statuses_clients_rely_on():
    assert {c: s for c, (s, _) in BUS_TO_HTTP.items()} == {
        "bad_request": 400,
        "not_found": 404,
        "no_engine": 503,
        "overloaded": 503,
        "busy": 429,
        "over_budget": 429,
        "timeout": 504,
        "engine_failed": 502,
        "cancelled": 499,
        "internal": 502,
        "forbidden": 403,
        "unavailable": 502,
        "conflict": 409,
        "stale_leader": 503,  # a former leader's command: a later try reaches the new one
    }


def test_only_unavailable_and_busy_codes_carry_retry_after():
    with_header = {c for c in BUS_TO_HTTP if "Retry-After" in from_bus(BusError(c, "m"), 3).headers}
    assert with_header == {
        "no_engine",
        "overloaded",
        "busy",
        "stale_leader",
    }  # a full engine queue: come back in a moment


def test_an_unknown_bus_code_is_a_502():
    err = from_bus(BusError("weird", "m"), 1)
    assert (err.status, err.type, err.code, err.headers) == (502, "engine_error", "weird", {})


@pytest.mark.parametrize("status", sorted(HTTP_TYPES))
def test_from_http_known_statuses(status):
    err = from_http(status, "nope")
    assert (err.status, err.message, err.param) == (status, "nope", None)
    assert (err.type, err.code) == HTTP_TYPES[status]


def test_from_http_common_codes():
    assert (from_http(401, "x").code, from_http(404, "x").code, from_http(429, "x").type) == (
        "invalid_api_key",
        "not_found",
        "rate_limit_error",
    )


@pytest.mark.parametrize(
    "status, type_",
    [(500, "server_error"), (503, "server_error"), (418, "invalid_request_error"), (422, "invalid_request_error")],
)
def test_from_http_unknown_statuses(status, type_):
    err = from_http(status, "d")
    assert (err.status, err.type, err.code) == (status, type_, f"http_{status}")


def test_body_has_exactly_the_openai_shape():
    err = ApiError(400, "bad temp", code="invalid_request", param="temperature")
    assert err.body() == {
        "error": {
            "message": "bad temp",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_request",
        }
    }
    assert msgspec.json.decode(err.encode()) == err.body()


def test_body_keeps_null_param_and_code():
    err = ApiError(500, "boom", type="server_error")
    assert err.body() == {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}
    assert err.encode() == b'{"error":{"message":"boom","type":"server_error","param":null,"code":null}}'


def test_api_error_is_an_exception_with_its_message():
    err = ApiError(404, "no such model", headers={"X": "1"})
    assert isinstance(err, Exception) and str(err) == "no such model"
    assert err.headers == {"X": "1"}
    assert ApiError(404, "m").headers == {}
