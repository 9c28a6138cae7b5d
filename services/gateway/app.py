"""The gateway's HTTP app: OpenAI-compatible routes on litestar, served by granian."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.response import Stream
from redis.exceptions import RedisError

from coderai.accounts.keys import KeyStore
from coderai.accounts.limits import Limited, Limiter
from coderai.contracts import BusError, Chunk, ErrorReply, Final, ModelConfig
from coderai.contracts.topology import HDR_KEY_NAME, HDR_REQUEST_ID
from coderai.gateway import affinity
from coderai.gateway.admin import admin_routes
from coderai.gateway import openai_types as oa
from coderai.gateway import sse
from coderai.gateway.auth import Authenticator, Caller, load_keys
from coderai.gateway.catalog import Catalog
from coderai.gateway.catalog_admin import catalog_routes
from coderai.gateway.errors import ApiError, from_bus, from_http
from coderai.gateway.finetune import finetune_routes
from coderai.gateway.media import media_routes
from coderai.gateway.relay import Hints, Outcome, Relay, next_frame
from coderai.gateway.settings import GatewaySettings
from coderai.gateway.ui import ui_routes
from coderai.gateway.videos import VideoJobs, video_routes
from coderai.runtime.blobs import BlobService, BlobStore
from coderai.runtime.bus import Bus
from coderai.runtime.logging import request_id_var, setup_logging
from coderai.runtime.settings import SettingsError, load_settings
from coderai.runtime.tracing import setup_tracing

log = logging.getLogger("coderai.gateway")
JSON = "application/json"
SESSION_HEADER = "X-Session-Id"
PIN_HEADER = "X-Coderai-Pin"  # admin only: route to this engine or node id
ENGINE_HEADER = "Coderai-Engine"
ROUTE_HEADER = "Coderai-Route"
SPAN_NAMES = {"chat": "POST /v1/chat/completions", "complete": "POST /v1/completions"}  # request span per op


class Gateway:
    """State shared by the routes of one gateway process."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.auth = Authenticator(None if settings.no_auth else load_keys(settings.api_keys_file))
        self.bus: Bus | None = None
        self.redis: Any = None
        self.limiter: Limiter | None = None
        self.catalog: Catalog | None = None
        self.relay: Relay | None = None
        self.blobs: BlobStore | None = None
        self.reconnect_hooks: list[Callable[[], None]] = []  # after a reconnect: restart watches (video jobs)

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Litestar) -> AsyncIterator[None]:
        if self.settings.redis_url:
            import redis.asyncio as aioredis

            self.redis = aioredis.from_url(self.settings.redis_url)
            self.auth.store = KeyStore(self.redis)
            self.limiter = Limiter(self.redis)
        self.bus = await Bus.connect_as(self.settings, "gateway", on_reconnect=self._on_reconnect,
                                     on_disconnect=self._on_disconnect)
        self.catalog = Catalog(self.bus)
        self.catalog.start()
        self.relay = Relay(self.bus, self.settings)
        self.blobs = BlobStore(self.bus, create=True, max_bytes=self.settings.blobs_max_bytes)
        # workers store large outputs there but may not create it: it must exist before the first one answers
        try:
            await self.blobs.store()
        except Exception as exc:  # noqa: BLE001 - JetStream not ready yet: the first upload here creates it
            log.warning("could not create the blob store yet (%s); the first upload will", exc)
        await BlobService(self.blobs).start(self.bus)  # nodes read and write blobs only through this, by name
        log.info("gateway listening on http://%s:%d", self.settings.host, self.settings.port)
        try:
            yield
        finally:
            self.catalog.stop()
            await self.bus.close()
            if self.redis is not None:
                await self.redis.aclose()

    async def _on_reconnect(self) -> None:
        if self.catalog:
            self.catalog.start()
        for hook in self.reconnect_hooks:
            hook()

    async def _on_disconnect(self) -> None:
        if self.bus:
            self.bus.fail_streams()

    async def admit(self, who: Caller, cfg: ModelConfig | None, job: Any) -> float:
        """A Redis key's model allow-list, rates and budget, checked before any work is done; returns the cost
        estimate reserved against the key's budget (0 without one). Without a model (a file upload) only the
        rates and a spent budget count."""
        key = who.key
        if key is None:
            return 0.0
        if cfg is not None and key.models and cfg.name not in key.models:
            raise ApiError(403, f"This key may not use the model '{cfg.name}'.", param="model", code="model_not_allowed")
        estimate = estimate_cost(cfg, job) if key.budget_usd and cfg is not None and job is not None else 0.0
        if self.limiter is not None and (key.rpm or key.tpm or key.budget_usd):
            try:
                await self.limiter.admit(key.name, key.rpm, key.tpm, key.budget_usd, key.budget_period, estimate)
            except Limited as lim:
                code = "insufficient_quota" if "budget" in lim.what else "rate_limit_exceeded"
                raise ApiError(429, f"Over this key's {lim.what}.", type="rate_limit_error", code=code,
                               headers={"Retry-After": str(max(1, math.ceil(lim.retry_after_s)))}) from None
            except (OSError, RedisError) as exc:
                raise ApiError(503, f"The limits store is unavailable: {exc}", type="service_unavailable",
                               code="key_store_unavailable", headers={"Retry-After": "5"}) from None
        return estimate

    async def finish(self, outcome: Outcome, who: Caller, cfg: ModelConfig, estimate: float = 0.0) -> None:
        """Price the request, charge a Redis key's token rate and budget, publish `request.completed`."""
        outcome.cost_usd = (outcome.prompt_tokens * cfg.price_prompt_per_mtok
                            + outcome.completion_tokens * cfg.price_completion_per_mtok) / 1e6
        key = who.key
        if key is not None and self.limiter is not None and (key.tpm or key.budget_usd):
            try:
                await self.limiter.charge(key.name, outcome.prompt_tokens + outcome.completion_tokens, key.tpm,
                                          outcome.cost_usd, key.budget_period, key.budget_usd, estimate)
            except Exception as exc:  # noqa: BLE001 - a lost charge must not fail an answered request
                log.warning("could not charge key %s: %s", key.name, exc)
        assert self.relay is not None
        await self.relay.completed(outcome)

    def model(self, name: str):
        assert self.catalog is not None and self.bus is not None
        cfg = self.catalog.models.get(name)
        if cfg is None:
            if not self.bus.connected and not self.catalog.models:
                raise ApiError(503, "The cluster is unavailable; try again shortly.", type="service_unavailable",
                               code="no_engine", headers={"Retry-After": str(self.settings.retry_after_s)})
            raise ApiError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")
        return cfg


def _json(obj: Any, status: int = 200) -> Response:
    return Response(content=sse._enc.encode(obj), status_code=status, media_type=JSON)


def _error_response(exc: ApiError) -> Response:
    return Response(content=exc.encode(), status_code=exc.status, media_type=JSON, headers=exc.headers)


def create_app(settings: GatewaySettings | None = None) -> Litestar:
    """The ASGI app; with no settings they are read from `CODERAI_GATEWAY_*` (what granian workers do)."""
    if settings is None:
        settings = load_settings(GatewaySettings, "gateway")
        setup_logging("gateway", settings.node_id, settings.log_level, settings.log_format)
        setup_tracing("gateway", settings.node_id)
    check_auth_settings(settings)
    gw = Gateway(settings)
    videos = VideoJobs(gw)

    async def caller(request: Request, scope: str = "inference") -> Caller:
        return await gw.auth.check(request.headers.get("authorization"), scope)

    @get("/healthz", media_type=JSON)
    async def healthz() -> Response:
        ok = gw.bus is not None and gw.bus.connected
        return _json({"status": "ok" if ok else "degraded", "bus": ok}, 200 if ok else 503)

    @get("/v1/models")
    async def list_models(request: Request) -> Response:
        await caller(request)
        assert gw.catalog is not None
        data = [_model_json(m) for m in sorted(gw.catalog.models.values(), key=lambda m: m.name)]
        return _json({"object": "list", "data": data})

    @get("/v1/models/{model_id:path}")
    async def get_model(request: Request) -> Response:

        model_id = request.path_params["model_id"]
        await caller(request)
        return _json(_model_json(gw.model(model_id.lstrip("/"))))

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request) -> Response | Stream:
        who = await caller(request)
        req = oa.parse(await request.body(), oa.ChatCompletionRequest)
        job = oa.chat_job(req, _rid())
        hints = _hints(request, who, job.model, req.user, affinity.chat_chain(job.model, job.messages, job.tools))
        return await _serve(gw, "chat", req, job, hints, who)

    @post("/v1/completions", status_code=200)
    async def completions(request: Request) -> Response | Stream:
        who = await caller(request)
        req = oa.parse(await request.body(), oa.CompletionRequest)
        job = oa.completion_job(req, _rid())
        hints = _hints(request, who, job.model, req.user, affinity.prompt_chain(job.model, job.prompt))
        return await _serve(gw, "complete", req, job, hints, who)

    def on_api_error(_: Request, exc: ApiError) -> Response:
        return _error_response(exc)

    def on_http_error(request: Request, exc: HTTPException) -> Response:
        err = from_http(exc.status_code, str(exc.detail))
        field = UPLOAD_FIELDS.get(request.url.path)
        if exc.status_code == 413 and field:  # the body as a whole was refused before any field was read
            err.param = field
            err.message = f"The upload in '{field}' is over the {settings.max_upload_bytes / 1e6:.0f} MB limit."
        err.headers.update(getattr(exc, "headers", None) or {})
        return _error_response(err)

    def on_error(_: Request, exc: Exception) -> Response:
        log.error("unhandled error", exc_info=exc)
        return _error_response(ApiError(500, "Internal error; see the gateway log for this request id.", type="server_error", code="internal"))

    return Litestar(
        route_handlers=[healthz, list_models, get_model, chat, completions, *media_routes(gw, caller, _rid),
                        *video_routes(gw, caller, _rid, videos), *admin_routes(gw, caller), *catalog_routes(gw, caller),
                        *finetune_routes(gw, caller),
                        *ui_routes()],
        lifespan=[gw.lifespan, videos.lifespan],  # entered in order: the video sweeper needs the bus
        exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, Exception: on_error},
        request_max_body_size=settings.max_body_bytes,  # upload routes allow more (media.py)
        openapi_config=None,
        debug=False,
    )


def _hints(request: Request, who: Caller, model: str, user: str | None, prefix: list[str]) -> Hints:
    pin = request.headers.get(PIN_HEADER, "")
    if pin and "admin" not in who.scopes:
        raise ApiError(403, f"The {PIN_HEADER} header needs an admin key.", code="forbidden")
    return Hints(
        session=affinity.session_key(model, request.headers.get(SESSION_HEADER)),
        user=affinity.user_key(model, user),
        prefix=prefix,
        pin=pin,
    )


def _rid() -> str:
    """A request id: random (no id in a response header says anything about another request's)."""
    rid = secrets.token_hex(12)
    request_id_var.set(rid)
    return rid


UPLOAD_FIELDS = {"/v1/audio/transcriptions": "file", "/v1/audio/translations": "file", "/v1/audio/diarization": "file",
                 "/v1/ocr": "file", "/v1/images/edits": "image", "/v1/files": "file"}
KINDS = {"chat": "chat", "complete": "completion", "embed": "embedding", "rerank": "rerank", "image": "image",
         "speech": "speech", "transcribe": "transcription", "diarize": "diarization", "ocr": "ocr", "video": "video"}


def _model_json(m: ModelConfig) -> dict[str, Any]:
    """OpenAI's model object, plus what it is for: `kind` (its first op's kind) and every op it serves."""
    ops = m.serves()
    return {"id": m.name, "object": "model", "created": m.created, "owned_by": m.owned_by,
            "kind": KINDS.get(ops[0], ops[0]) if ops else "unknown", "capabilities": [KINDS.get(o, o) for o in ops],
            "engine": m.engine}


def estimate_cost(cfg: ModelConfig, job: Any) -> float:
    """A generous cost estimate for budget reservations: prompt tokens as half the characters of the request's
    JSON (tokenizers give about 3-4 characters a token, and templates add a few), plus every token it may generate
    (max_tokens, else the whole context)."""
    if not hasattr(job, "params"):  # a media job: its text (prompt, input, documents) is what is priced
        return (len(msgspec.json.encode(job)) / 2 + 16) * cfg.price_prompt_per_mtok / 1e6
    text = msgspec.json.encode(job.messages if hasattr(job, "messages") else job.prompt)
    prompt = len(text) / 2 + 16
    n = max(1, job.params.n)
    completion = (job.params.max_tokens or int(cfg.params.get("n_ctx", 4096))) * n
    return (prompt * n * cfg.price_prompt_per_mtok + completion * cfg.price_completion_per_mtok) / 1e6


def check_auth_settings(settings: GatewaySettings) -> None:
    """No auth is a deliberate choice for one machine only; any other host needs a keys file."""
    if settings.no_auth and not is_loopback(settings.host):
        raise SettingsError(f"--no-auth is only allowed on a loopback host, not {settings.host}")
    if not settings.no_auth and not settings.api_keys_file:
        raise SettingsError("CODERAI_GATEWAY_API_KEYS_FILE is not set: give a keys file, or --no-auth on loopback")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _serve(gw: Gateway, op: str, req: Any, job: Any, hints: Hints, who: Caller) -> Response | Stream:
    """Validate the model, then answer streamed or whole; every outcome becomes one `request.completed`."""
    key_name = who.key_name
    cfg = gw.model(job.model)
    if op not in cfg.serves():
        raise ApiError(400, f"The model '{job.model}' does not serve {op}.", param="model", code="unsupported_operation")
    estimate = await gw.admit(who, cfg, job)
    assert gw.relay is not None
    relay = gw.relay
    outcome = Outcome(request_id=job.request_id, key_name=key_name, model=job.model, op=op, stream=job.stream)
    outcome.start_span(SPAN_NAMES[op])
    headers = {HDR_REQUEST_ID: job.request_id, HDR_KEY_NAME: key_name}
    created = int(time.time())
    try:
        stream, first = await relay.first_frame(op, job, hints, outcome, headers)
    except (BusError, ApiError) as exc:
        err = from_bus(exc, gw.settings.retry_after_s) if isinstance(exc, BusError) else exc
        outcome.status, outcome.http_status = err.code or "error", err.status
        await gw.finish(outcome, who, cfg, estimate)
        raise err from None
    outcome.ttft_s = time.monotonic() - outcome.started
    resp_headers = {HDR_REQUEST_ID: job.request_id, ENGINE_HEADER: outcome.engine_id, ROUTE_HEADER: outcome.route_reason}

    if not job.stream:
        try:
            final = first if isinstance(first, Final) else await _until_final(stream)
        except asyncio.CancelledError:  # the client went away: stop the engine too, and still account for it
            relay.spawn(stream.cancel())
            outcome.status, outcome.http_status = "cancelled", 499
            relay.spawn(gw.finish(outcome, who, cfg, estimate))
            raise
        except BusError as exc:
            err = from_bus(exc, gw.settings.retry_after_s)
            outcome.status, outcome.http_status = err.code or "error", err.status
            await gw.finish(outcome, who, cfg, estimate)
            raise err from None
        finally:
            stream.close()
        outcome.prompt_tokens, outcome.completion_tokens = final.usage.prompt_tokens, final.usage.completion_tokens
        await gw.finish(outcome, who, cfg, estimate)
        build = sse.chat_response if op == "chat" else sse.completion_response
        return Response(content=sse._enc.encode(build(job.request_id, created, job.model, final.choices, final.usage)),
                        media_type=JSON, headers=resp_headers)

    chunk_bytes = sse.chat_chunk if op == "chat" else sse.completion_chunk
    want_usage = oa.include_usage(req)

    async def events() -> AsyncIterator[bytes]:
        frame: Any = first
        finished = False
        try:
            while True:
                if isinstance(frame, Chunk):
                    yield chunk_bytes(job.request_id, created, job.model, frame)
                elif isinstance(frame, Final):
                    outcome.prompt_tokens, outcome.completion_tokens = frame.usage.prompt_tokens, frame.usage.completion_tokens
                    if want_usage:
                        yield sse.usage_chunk(op, job.request_id, created, job.model, frame.usage)
                    yield sse.DONE
                    finished = True
                    return
                elif isinstance(frame, ErrorReply):
                    raise BusError.from_reply(frame)
                frame = await next_frame(stream)
        except BusError as exc:
            # Headers are gone already: the error travels as an SSE event the openai SDK raises on.
            err = from_bus(exc, gw.settings.retry_after_s)
            outcome.status, outcome.http_status = err.code or "error", err.status
            finished = True
            yield sse.sse(err.body())
        finally:
            if not finished:  # the client went away mid-stream: stop the engine
                outcome.status, outcome.http_status = "cancelled", 499
                relay.spawn(stream.cancel())
            else:
                stream.close()
            relay.spawn(gw.finish(outcome, who, cfg, estimate))  # may run while the stream task is being cancelled

    return Stream(events(), media_type="text/event-stream",
                  headers={**resp_headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _until_final(stream) -> Final:
    while True:
        frame = await next_frame(stream)
        if isinstance(frame, Final):
            return frame
        if isinstance(frame, ErrorReply):
            raise BusError.from_reply(frame)
