"""The gateway's HTTP app (litestar, served by granian): its controllers, lifespans, dependencies and the table
that turns every exception into OpenAI-style error JSON."""

from __future__ import annotations

import logging

from litestar import Litestar, Request, Response, get
from litestar.exceptions import HTTPException
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
from nats.js.errors import ServiceUnavailableError

from coderai.gateway.admin.catalog import CatalogController, Pulls
from coderai.gateway.admin.keys import KeysController
from coderai.gateway.admin.metrics import MetricsController
from coderai.gateway.admin.models import LiveModelsController
from coderai.gateway.admin.nodes import NodesController
from coderai.gateway.admin.pods import PodsController
from coderai.gateway.contract import ContractController
from coderai.gateway.errors import ApiError, from_http
from coderai.gateway.http import error_response, json_response
from coderai.gateway.batches.runner import BatchRunner
from coderai.gateway.openai.audio import AudioController
from coderai.gateway.openai.batches import BatchesController
from coderai.gateway.openai.chat import ChatController
from coderai.gateway.openai.embeddings import EmbeddingsController
from coderai.gateway.openai.files import FilesController, Records
from coderai.gateway.openai.fine_tuning import FineTuningController
from coderai.gateway.openai.loras import LorasController
from coderai.gateway.openai.images import BlobsController, ImagesController
from coderai.gateway.openai.models import ModelsController
from coderai.gateway.openai.ocr import OcrController
from coderai.gateway.openai.responses import ResponsesController
from coderai.gateway.openai.responses_store import Responses
from coderai.gateway.ollama import OllamaController
from coderai.gateway.anthropic import AnthropicController
from coderai.gateway.openai.videos import VideosController
from coderai.gateway.settings import GatewaySettings, check_auth_settings
from coderai.gateway.state import Gateway, GatewayController
from coderai.gateway.ui import ui_routes
from coderai.gateway.video.takeover import VideoJobs
from coderai.runtime.logging import setup_logging
from coderai.runtime.settings import load_settings
from coderai.runtime.tracing import setup_tracing

log = logging.getLogger("coderai.gateway")

CONTROLLERS: list[type[GatewayController]] = [
    ModelsController,
    ChatController,
    EmbeddingsController,
    ImagesController,
    BlobsController,
    AudioController,
    ResponsesController,
    OcrController,
    VideosController,
    FilesController,
    FineTuningController,
    LorasController,
    AnthropicController,
    BatchesController,
    OllamaController,
    ContractController,
    NodesController,
    KeysController,
    PodsController,
    CatalogController,
    MetricsController,
    LiveModelsController,
]


class HealthController(GatewayController):
    @get("/healthz")
    async def healthz(self) -> Response:
        ok = self.gw.bus.connected
        return json_response({"status": "ok" if ok else "degraded", "bus": ok}, 200 if ok else 503)


def create_app(settings: GatewaySettings | None = None) -> Litestar:
    """The ASGI app; with no settings they are read from `CODERAI_GATEWAY_*` (what granian workers do)."""
    if settings is None:
        settings = load_settings(GatewaySettings, "gateway")
        setup_logging("gateway", settings.node_id, settings.log_level, settings.log_format)
        setup_tracing("gateway", settings.node_id)
    check_auth_settings(settings)
    gw = Gateway(settings)
    videos, records, pulls = VideoJobs(gw), Records(gw), Pulls(gw)
    batches = BatchRunner(gw, records)

    def on_http_error(_: Request, exc: HTTPException) -> Response:
        err = from_http(exc.status_code, str(exc.detail))
        err.headers.update(getattr(exc, "headers", None) or {})
        return error_response(err)

    def on_error(_: Request, exc: Exception) -> Response:
        if isinstance(exc, (NatsTimeout, NoRespondersError, ServiceUnavailableError)):
            # the bus or a JetStream leader did not answer (a head's failover, a cluster still forming): the
            # request may be sent again, as the SDKs do with a 503, and it is no fault of the gateway's code
            log.warning("the message bus did not answer: %s", exc or type(exc).__name__)
            return error_response(
                ApiError(
                    503,
                    "The message bus did not answer in time; try again shortly.",
                    type="service_unavailable",
                    code="bus_unavailable",
                    headers={"Retry-After": str(settings.retry_after_s)},
                )
            )
        log.error("unhandled error", exc_info=exc)
        return error_response(
            ApiError(
                500, "Internal error; see the gateway log for this request id.", type="server_error", code="internal"
            )
        )

    state = {
        "gw": gw,
        "videos": videos,
        "records": records,
        "pulls": pulls,
        "responses": Responses(gw),
        "batches": batches,
    }
    app = Litestar(
        route_handlers=[*(bound(c, state) for c in [HealthController, *CONTROLLERS]), *ui_routes()],
        lifespan=[gw.lifespan, videos.lifespan, batches.lifespan],  # entered in order: the sweepers need the bus
        exception_handlers={
            ApiError: lambda _, exc: error_response(exc),
            HTTPException: on_http_error,
            Exception: on_error,
        },
        # JSON bodies are held to max_body_bytes by `http.read_json`; uploads to this (one file and the form)
        request_max_body_size=max(settings.max_body_bytes, settings.max_upload_bytes + 1024 * 1024),
        openapi_config=None,
        # litestar's default config replaces the root logger's handlers with its own text format: the gateway's
        # lines would no longer be JSON, nor reach the ring the admin API reads
        logging_config=None,
        debug=False,
    )
    app.state.gateway = gw  # the guards' way to the keys
    return app


def bound(controller: type[GatewayController], state: dict[str, object]) -> type[GatewayController]:
    """`controller` for one app: a subclass holding the state its annotations name (`gw`, and `videos`, ...)."""
    declared = {name for cls in controller.__mro__ for name in vars(cls).get("__annotations__", {})}
    return type(controller.__name__, (controller,), {k: v for k, v in state.items() if k in declared})
