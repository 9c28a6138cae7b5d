"""API errors and the one table that maps bus error codes to OpenAI error JSON and HTTP status."""

from __future__ import annotations

import math

from typing import Any

import msgspec

from coderai.contracts import BusError


class ApiError(Exception):
    """An error the client sees as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def encode(self) -> bytes:
        return msgspec.json.encode(self.body())


def unknown_model(name: str, param: str = "model") -> ApiError:
    """The 404 for a model that is not served, and, word for word, for one a key's allow-list leaves out: a key
    learns nothing of the models it may not use (not that they exist, nor what they serve)."""
    return ApiError(404, f"The model '{name}' does not exist.", param=param, code="model_not_found")


class ClientGone(ApiError):
    """The client disconnected before its answer: what the request's task raises instead of the cancellation that
    stopped it, so that the server (granian) does not log a cancelled request as a crashed one. The 499 it renders
    reaches nobody; the request was accounted as cancelled, and logged once, by the pipeline."""

    def __init__(self) -> None:
        super().__init__(499, "The client closed the request.", type="cancelled", code="cancelled")


# bus code -> (HTTP status, OpenAI error type)
BUS_TO_HTTP: dict[str, tuple[int, str]] = {
    "bad_request": (400, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "no_engine": (503, "service_unavailable"),
    "overloaded": (503, "service_unavailable"),
    "busy": (429, "rate_limit_error"),
    "over_budget": (429, "insufficient_quota"),
    "forbidden": (403, "permission_error"),
    "conflict": (409, "invalid_request_error"),
    "stale_leader": (503, "service_unavailable"),
    "unavailable": (502, "engine_error"),  # a head that cannot change its members: not the client's to retry
    "timeout": (504, "timeout"),
    "engine_failed": (502, "engine_error"),
    "cancelled": (499, "cancelled"),
    "internal": (502, "engine_error"),
}

HTTP_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "bad_request"),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "forbidden"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    429: ("rate_limit_error", "rate_limited"),
}


def from_bus(exc: BusError, retry_after_s: int) -> ApiError:
    status, type_ = BUS_TO_HTTP.get(exc.code, (502, "engine_error"))
    if exc.retry_after_s is not None:  # the engine's own estimate (a queue's expected wait)
        retry_after_s = max(1, math.ceil(exc.retry_after_s))
    headers = {"Retry-After": str(retry_after_s)} if status == 503 or exc.code == "busy" else None
    return ApiError(status, exc.message, type=type_, code=exc.code, param=exc.param, headers=headers)


def from_http(status: int, detail: str) -> ApiError:
    type_, code = HTTP_TYPES.get(
        status, ("server_error" if status >= 500 else "invalid_request_error", f"http_{status}")
    )
    return ApiError(status, detail, type=type_, code=code)
