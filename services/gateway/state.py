"""The state one gateway process shares between its controllers, injected into them as `gw: Gateway`."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from litestar import Controller, Litestar, Request

from coderai.accounts.keys import KeyJournal, KeyStore
from coderai.accounts.limits import Limiter, SpendHistory
from coderai.contracts import ModelConfig
from coderai.contracts.topology import EVENTS
from coderai.gateway import blob_urls, seal
from coderai.gateway.accounting import Accounts, may_use
from coderai.accounts.keyfile import load_keys
from coderai.gateway.auth import CALLER, Authenticator, Caller, admin_guard, inference_guard
from coderai.gateway.catalog import Catalog
from coderai.gateway.copies import Copies
from coderai.gateway.fanout.gate import QueueGate
from coderai.gateway.errors import ApiError, unknown_model
from coderai.gateway.relay import Relay
from coderai.gateway.settings import GatewaySettings
from coderai.runtime.blobs import BlobService, BlobStore
from coderai.runtime.bus import Bus

log = logging.getLogger("coderai.gateway")


class Gateway:
    """Bus, Redis, limits, catalogue, loaded copies, relay and blobs of one gateway process; set up by `lifespan`."""

    bus: Bus
    catalog: Catalog
    copies: Copies
    relay: Relay
    queue_gate: QueueGate
    blobs: BlobStore
    accounts: Accounts

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.auth = Authenticator(None if settings.no_auth else load_keys(settings.api_keys_file))
        self.redis: Any = None  # redis.asyncio.Redis, when CODERAI_GATEWAY_REDIS_URL is set
        self.reconnect_hooks: list[Callable[[], None]] = []  # after a reconnect: restart watches (video jobs)
        seal.configure(settings.data_dir)  # the cluster's key for reasoning handed to clients and taken back
        blob_urls.configure(settings.data_dir)  # and the one blob URLs are signed with

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Litestar) -> AsyncIterator[None]:
        limiter = None
        if self.settings.redis_url:
            from coderai.runtime import redis_client

            self.redis = redis_client.connect(self.settings.redis_url)  # redis:// or redis+sentinel://
            self.auth.store = KeyStore(self.redis)
            limiter = Limiter(self.redis)
        self.bus = await Bus.connect_as(
            self.settings, "gateway", on_reconnect=self._on_reconnect, on_disconnect=self._on_disconnect
        )
        if self.auth.store is not None:  # keys and revocations journalled beyond Redis (coderai_keys)
            self.auth.store.journal = KeyJournal(self.bus)
        if limiter is not None:  # budgets' spend summed again from EVENTS when Redis lost it
            limiter.history = SpendHistory(self.bus)
        # request.completed events journalled in the data dir until NATS acks them: a gateway killed after an
        # answer has its events sent by the next one to start here (services/gateway/outbox.py)
        self.accounts = Accounts(self.bus, limiter, Path(os.path.expanduser(self.settings.data_dir)) / "gateway-outbox")
        # the gateway makes the events usage is built from, so it makes their stream too: they are kept while the
        # metrics service (which made it before) is down, and a publish always has a stream to ack it
        try:
            await self.bus.ensure_stream(EVENTS)
        except Exception as exc:  # JetStream not ready: the outbox keeps the events until it is
            log.warning("could not create the EVENTS stream yet (%s)", exc)
        self.accounts.start()
        self.catalog = Catalog(self.bus)
        self.catalog.start()
        self.copies = Copies(self.bus)
        self.copies.start()
        picker = None
        if self.settings.local_pick:
            from coderai.gateway.picker import Picker

            picker = Picker(self.bus)
            picker.start()
            self.reconnect_hooks.append(picker.on_reconnect)
            self.accounts.on_done = lambda done: picker.completed(done.engine_id)
        self.relay = Relay(self.bus, self.settings, picker)
        self.queue_gate = QueueGate(self.bus)
        self.blobs = BlobStore(self.bus, create=True, max_bytes=self.settings.blobs_max_bytes)
        # workers store large outputs there but may not create it: it must exist before the first one answers
        try:
            await self.blobs.store()
        except Exception as exc:  # JetStream not ready yet: the first upload here creates it
            log.warning("could not create the blob store yet (%s); the first upload will", exc)
        await BlobService(self.blobs).start(self.bus)  # nodes read and write blobs only through this, by name
        log.info("gateway listening on http://%s:%d", self.settings.host, self.settings.port)
        try:
            yield
        finally:
            self.catalog.stop()
            self.copies.stop()
            self.queue_gate.stop()
            if self.relay.picker is not None:
                await self.relay.picker.stop()
            await self.accounts.close()  # the last request.completed events sent before the bus drains
            await self.bus.close()
            if self.redis is not None:
                await self.redis.aclose()

    async def _on_reconnect(self) -> None:
        self.catalog.start()
        self.copies.start()
        for hook in self.reconnect_hooks:
            hook()

    async def _on_disconnect(self) -> None:
        self.bus.fail_streams()

    def model(self, name: str, op: str | None = None) -> ModelConfig:
        """The served model `name`, checked to serve `op` when given (400 if not). A name the catalogue lacks is a 404
        only when the catalogue is complete; while it is being rebuilt it is a 503 with `Retry-After` (an SDK
        retries that, never a 404). `find_model` waits for the rebuild first."""
        cfg = self.catalog.models.get(name)
        if cfg is None:
            if not self.catalog.complete:
                raise self.not_ready()
            raise unknown_model(name)
        if op is not None and op not in cfg.serves():
            raise ApiError(
                400,
                f"The model '{name}' does not serve {op}; it serves {', '.join(cfg.serves())}.",
                param="model",
                code="unsupported_operation",
            )
        return cfg

    def not_ready(self) -> ApiError:
        """What a request gets when this gateway's view of the models is being rebuilt for longer than the failover
        budget (or the bus is down): 503, retried by every SDK."""
        return ApiError(
            503,
            "The cluster's view of its models is being rebuilt (a failover or reconnect); try again shortly.",
            type="service_unavailable",
            code="no_engine",
            headers={"Retry-After": str(self.settings.retry_after_s)},
        )

    async def find_model(self, name: str, op: str | None = None) -> ModelConfig:
        """`model(name, op)`, after waiting (up to the failover budget) for an incomplete catalogue to be whole
        again when it lacks `name`."""
        if name not in self.catalog.models and not self.catalog.complete:
            await self.catalog.wait_complete(self.settings.failover_wait_s)
        return self.model(name, op)

    async def visible_models(self, who: Caller) -> list[ModelConfig]:
        """The served models a key may use, by name: all of them, or those of its allow-list, less the models other
        keys own. A list from a catalogue being rebuilt could lack some: it waits for the whole one (bounded),
        else 503."""
        if not self.catalog.complete and not await self.catalog.wait_complete(self.settings.failover_wait_s):
            raise self.not_ready()
        return [m for m in sorted(self.catalog.models.values(), key=lambda m: m.name) if may_use(who, m.name, m.owner)]

    async def visible_model(self, who: Caller, name: str) -> ModelConfig:
        """`find_model(name)` for a key that may use it; a model outside its allow-list is as unknown as a missing
        one."""
        if not may_use(who, name):
            raise unknown_model(name)
        cfg = await self.find_model(name)
        if not may_use(who, name, cfg.owner):
            raise unknown_model(name)
        return cfg

    def first_model(self, op: str) -> ModelConfig | None:
        """The first served model (by name) that serves `op`."""
        return next((m for m in sorted(self.catalog.models.values(), key=lambda m: m.name) if op in m.serves()), None)


class GatewayController(Controller):
    """A controller of one gateway app. Its state is bound to the class when the app is made (`app.py:bound`), so a
    handler reaches it as `self.gw` (and `self.videos`, `self.records`, `self.pulls` where a controller declares
    them), typed, with nothing resolved per request: litestar's dependency injection costs the hot path more than
    the rest of the pipeline. `self.caller(request)` is the caller the controller's guard admitted."""

    gw: Gateway

    @staticmethod
    def caller(request: Request) -> Caller:
        return request.scope["state"][CALLER]


class InferenceController(GatewayController):
    """A controller of the OpenAI-compatible API: every route wants a key with the `inference` scope."""

    before_request = inference_guard


class AdminController(GatewayController):
    """A controller under `/admin`: every route wants a key with the `admin` scope."""

    path = "/admin"
    before_request = admin_guard
