"""HTTP plumbing every controller shares: JSON bodies in (only as `application/json`, errors naming the field),
JSON answers out, request ids and the response headers coderai adds."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response
from litestar.exceptions import InternalServerException
from litestar.types import Receive, Scope, Send

from coderai.contracts.topology import HDR_REQUEST_ID
from coderai.gateway.errors import ApiError, ClientGone
from coderai.runtime import ids
from coderai.runtime.logging import request_id_var

T = TypeVar("T")
N = TypeVar("N", int, float)

JSON = "application/json"
SESSION_HEADER = "X-Session-Id"
# the sessions harnesses name in headers of their own, on any API, after X-Session-Id and an API's own session
# (Claude Code's metadata, Codex's prompt_cache_key): Open WebUI's chat id (with ENABLE_FORWARD_USER_INFO_HEADERS),
# Codex's and Claude Code's session headers
HARNESS_SESSION_HEADERS = ("X-OpenWebUI-Chat-Id", "session-id", "thread-id", "X-Claude-Code-Session-Id")
PIN_HEADER = "X-Coderai-Pin"  # admin only: route to this engine or node id
ENGINE_HEADER = "Coderai-Engine"
ROUTE_HEADER = "Coderai-Route"
REQUEST_ID_HEADER = HDR_REQUEST_ID
CLIENT_REQUEST_ID_HEADER = "X-Client-Request-Id"  # OpenAI's: the client's own id for a request, kept with its usage
CLIENT_REQUEST_ID_MAX = 512  # OpenAI's bound: ASCII, at most 512 characters, else a 400
# a chat or completion that says it is background work waits behind interactive turns of its engine
PRIORITY_HEADER = "X-Coderai-Priority"
PRIORITIES = {"interactive": 0, "background": 1}
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
WATCH_AFTER_S = 0.2  # an answer still running this long starts watching for its client leaving

_enc = msgspec.json.Encoder()
# the HTTP request's X-Client-Request-Id, set by its controller's guard: every Call made while serving it takes it
client_request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("coderai_client_request_id", default="")
# the HTTP request's X-Coderai-Priority (None without one), set by the same guard
priority_var: contextvars.ContextVar[int | None] = contextvars.ContextVar("coderai_priority", default=None)


class JSONAnswer:
    """A JSON answer as a bare ASGI app: two sends, nothing else to build (a litestar `Response` normalises
    headers, cookies and background tasks first, on every request). Litestar passes it through as it is, from
    handlers annotated with `Response` too (`to_asgi_response`)."""

    __slots__ = ("body", "status", "headers")

    def __init__(self, obj: object, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.body = _enc.encode(obj)
        self.status = status
        self.headers = headers

    def to_asgi_response(self, *_args: object, **_kwargs: object) -> JSONAnswer:
        return self

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(self.body))]
        if self.headers:
            raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": self.status, "headers": raw})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


def json_response(obj: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """`obj` as a JSON answer (the one JSON helper of the gateway)."""
    return JSONAnswer(obj, status, headers)  # type: ignore[return-value]  # litestar sends it by to_asgi_response


def error_response(exc: ApiError) -> Response:
    return Response(content=exc.encode(), status_code=exc.status, media_type=JSON, headers=exc.headers)


def new_request_id() -> str:
    """A request id: random (no id in a response header says anything about another request's)."""
    rid = ids.token_hex(12)
    request_id_var.set(rid)
    return rid


def client_request_id(scope: Scope) -> str:
    """The request's `X-Client-Request-Id` ("" without one), which goes with its `request.completed` so that a
    client can match its own records against usage. Printable ASCII of at most 512 characters, as OpenAI takes it:
    anything else is a 400 (an id altered to fit would no longer match what the client logged)."""
    for name, value in scope["headers"]:
        if name == b"x-client-request-id":
            if len(value) > CLIENT_REQUEST_ID_MAX or not all(0x20 <= c < 0x7F for c in value):
                raise ApiError(
                    400,
                    f"{CLIENT_REQUEST_ID_HEADER} must be printable ASCII of at most "
                    f"{CLIENT_REQUEST_ID_MAX} characters.",
                    code="invalid_request",
                    param=CLIENT_REQUEST_ID_HEADER,
                )
            return value.decode("ascii")
    return ""


def request_priority(scope: Scope) -> int | None:
    """The request's `X-Coderai-Priority` (`interactive` or `background`), None without one; another value is a
    400 naming the two."""
    for name, value in scope["headers"]:
        if name == b"x-coderai-priority":
            got = PRIORITIES.get(value.decode("latin-1").strip().lower())
            if got is None:
                raise ApiError(
                    400,
                    f"{PRIORITY_HEADER} must be interactive or background.",
                    code="invalid_request",
                    param=PRIORITY_HEADER,
                )
            return got
    return None


def is_json(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == JSON


async def read_json(request: Request, type_: type[T], *, empty: bytes | None = None, any_type: bool = False) -> T:
    """The body as `type_`; a body that is not `application/json` is a 415, unless `any_type` (Ollama's routes read
    JSON whatever the content type says, as Ollama does: its documented `curl -d` sends a form type). `empty`: what
    an empty body means (admin commands whose fields all have defaults), else an empty body is a 400."""
    limit = request.app.state.gateway.settings.max_body_bytes
    headers = request.headers  # built anew from the scope at every access
    if int(headers.get("content-length") or 0) > limit:
        raise _too_large(limit)
    try:
        body = await request.body()
    except InternalServerException:  # litestar's "client disconnected prematurely": granian ended the body
        raise ApiError(
            400,
            "The request body ended before it was whole (a broken chunked encoding, or the client left).",
            code="incomplete_body",
        ) from None
    if len(body) > limit:
        raise _too_large(limit)
    if not body and empty is not None:
        return parse(empty, type_)
    if not any_type and not is_json(headers.get("content-type", "")):
        raise ApiError(
            415, "Send the body as JSON, with 'Content-Type: application/json'.", code="unsupported_media_type"
        )
    return parse(body, type_)


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"The request body is over the {limit} byte limit (CODERAI_GATEWAY_MAX_BODY_BYTES).",
        code="request_too_large",
    )


def parse(body: bytes, type_: type[T]) -> T:
    """Decode a JSON body: malformed or too deeply nested JSON, or a schema mismatch, is a 400 naming the field."""
    if not body:
        raise ApiError(400, "The request body is empty; send a JSON object.", code="invalid_json")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        text = str(exc)
        raise ApiError(400, f"Invalid request: {text}", code="invalid_request", param=_param_of(text)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "The request body is nested too deeply.", code="invalid_json") from None


def _param_of(text: str) -> str | None:
    """The field a msgspec validation message points at: "... - at `$.messages[0]`" or "missing required field `x`"."""
    if "$." in text:
        return text.rsplit("$.", 1)[-1].rstrip("`")
    if "required field `" in text:
        return text.split("required field `", 1)[1].split("`", 1)[0]
    return None


def number(name: str, raw: str, kind: type[N], lo: float, hi: float) -> N:
    """`raw` (a query or form field `name`) as a `kind` in [lo, hi]; a 400 naming it otherwise."""
    try:
        value = kind(raw)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise ApiError(400, f"'{name}' must be {what}, not {raw!r}.", param=name, code="invalid_value") from None
    if not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo:g} and {hi:g}.", param=name, code="invalid_value")
    return value


def query_int(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    """An integer query parameter in [lo, hi]."""
    return number(name, request.query_params.get(name, str(default)), int, lo, hi)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` in this task, cancelling it (and what it awaits: an engine job's call abandons it) if the
    client disconnects first. For answers that are not streamed yet (litestar watches a streamed one).

    The watch starts `WATCH_AFTER_S` in: most answers are done by then, and asking the server for the next ASGI
    message costs the hot path more than the rest of the pipeline. A client gone sooner is noticed then.

    The client leaving raises `ClientGone` once `work` has unwound (a 499 nobody reads): a CancelledError out of
    the handler is what the server logs as an application crash, with its traceback. A cancellation that is not
    the watch's alone (the server stopping) stays one."""
    task = asyncio.current_task()
    assert task is not None  # a handler runs in a task
    watch = _Watch(request, task)
    timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, watch.start)
    try:
        return await work
    except asyncio.CancelledError:
        if watch.gone and task.uncancel() == 0:
            raise ClientGone() from None
        raise
    finally:
        timer.cancel()
        watch.stop()


class _Watch:
    """The request's next ASGI message (the body is read already, so it is the disconnect), watched with a
    callback: granian's `receive` hands out a future; another server's coroutine gets a task."""

    __slots__ = ("gone", "request", "task", "waiter")

    def __init__(self, request: Request, task: asyncio.Task) -> None:
        self.request, self.task, self.waiter = request, task, None
        self.gone = False  # the client disconnected, and the task was cancelled for it

    def start(self) -> None:
        waiter: Any = self.request.receive()
        if not asyncio.isfuture(waiter):
            waiter = asyncio.ensure_future(waiter)
        waiter.add_done_callback(self._message)
        self.waiter = waiter

    def _message(self, done: Any) -> None:
        if not done.cancelled() and done.exception() is None and done.result().get("type") == "http.disconnect":
            self.gone = True
            self.task.cancel()

    def stop(self) -> None:
        if self.waiter is not None:
            self.waiter.remove_done_callback(self._message)
            self.waiter.cancel()
