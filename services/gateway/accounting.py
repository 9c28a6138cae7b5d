"""What a request may cost and what it did cost: a key's allow-list, rates and budget checked (and the budget
reserved) before any work, then its tokens and price charged and one `request.completed` built and published
when it ends. Only the pipeline calls `admit` and `finish` (`pipeline_admit.py`, `pipeline_account.py`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.errors import Error as NatsError
from redis.exceptions import RedisError

from coderai.accounts.limits import Limited, Limiter, Reservation
from coderai.contracts import ModelConfig, RequestCompleted
from coderai.gateway.auth import Caller
from coderai.gateway.errors import ApiError, unknown_model
from coderai.gateway.outbox import Outbox
from coderai.gateway.pricing import checked_work as checked_work  # re-exported: openai/videos.py imports it here
from coderai.gateway.pricing import estimate_cost
from coderai.runtime import tracing
from coderai.runtime.bus import Bus
from coderai.runtime.tracing import NO_SPAN

log = logging.getLogger("coderai.gateway")


class Trace:
    """The request's server span and the span of its call to the engine that answered (NO_SPAN while tracing is
    off: then nothing here costs anything)."""

    def __init__(self) -> None:
        self.span: Any = NO_SPAN
        self.engine_span: Any = NO_SPAN

    @property
    def on(self) -> bool:
        return self.span is not NO_SPAN

    def start(self, name: str, **attributes: Any) -> None:
        if tracing.enabled():
            self.span = tracing.start_span(
                name, kind="server", attributes={f"coderai.{k}": v for k, v in attributes.items()}
            )

    def end(self, done: RequestCompleted) -> None:
        if self.span is NO_SPAN:
            return
        if done.status != "ok":
            tracing.set_error(self.engine_span, done.status)
            tracing.set_error(self.span, done.status)
        self.engine_span.end()
        attrs: dict[str, Any] = {
            "coderai.status": done.status,
            "http.response.status_code": done.http_status,
            "coderai.engine_id": done.engine_id,
            "coderai.route_reason": done.route_reason,
            "coderai.prompt_tokens": done.prompt_tokens,
            "coderai.completion_tokens": done.completion_tokens,
        }
        if done.ttft_s is not None:
            attrs["coderai.ttft_s"] = done.ttft_s
        self.span.set_attributes(attrs)
        self.span.end()


NO_TRACE = Trace()  # while tracing is off: shared, never started, never changed


@dataclass(frozen=True)
class Admission:
    """What `admit` let through: the model (None for a file upload) and the budget it holds."""

    cfg: ModelConfig | None
    held: Reservation | None = None


def may_use(who: Caller, model: str, owner: str = "") -> bool:
    """Whether the key's model allow-list (none: every model) has `model`, and the model is for every key or this
    key owns it (`owner`: a fine-tuned model is its trainer's; admin keys reach every model)."""
    if owner and owner != who.key_name and "admin" not in who.scopes:
        return False
    key = who.key
    return key is None or not key.models or model in key.models


def allowed(who: Caller, model: str, owner: str = "") -> None:
    """A key with a model allow-list uses only those models, and a model another key owns is not its: anything else
    is the 404 of a model that does not exist, before anything else is looked at (what the model serves, the
    request's body), so a key cannot tell the models it may not use from those that are not there."""
    if not may_use(who, model, owner):
        raise unknown_model(model)


class Accounts:
    """Limits in Redis (none without it) and the `request.completed` events on the bus (through an outbox that
    keeps them across a NATS outage: `start` it, `close` it)."""

    def __init__(self, bus: Bus, limiter: Limiter | None, journal_dir: Path | None = None) -> None:
        self.bus = bus
        self.limiter = limiter
        self.outbox = Outbox(bus, journal_dir=journal_dir)
        self.on_done: Callable[[RequestCompleted], None] | None = None

    def start(self) -> None:
        self.outbox.start()

    async def close(self) -> None:
        await self.outbox.close()

    async def admit(self, who: Caller, cfg: ModelConfig | None, job: Any = None) -> Admission:
        """Check a Redis key's model allow-list, rates and budget; reserve the cost estimate against the budget.
        Without a model (a file upload) only the rates and a spent budget count."""
        key = who.key
        if key is None:
            return Admission(cfg)
        if cfg is not None:
            allowed(who, cfg.name, cfg.owner)
        estimate = estimate_cost(cfg, job) if key.budget_usd and cfg is not None and job is not None else 0.0
        if self.limiter is None or not (key.rpm or key.tpm or key.budget_usd):
            return Admission(cfg)
        try:
            held = await self.limiter.admit(key.name, key.rpm, key.tpm, key.budget_usd, key.budget_period, estimate)
        except Limited as lim:
            raise _over(lim) from None
        except (OSError, RedisError, NatsError) as exc:  # NATS: an emptied Redis's spend not read back from EVENTS
            raise ApiError(
                503,
                f"The limits store is unavailable: {exc}",
                type="service_unavailable",
                code="key_store_unavailable",
                headers={"Retry-After": "5"},
            ) from None
        return Admission(cfg, held)

    async def check_budget(self, who: Caller, cfg: ModelConfig, job: Any) -> None:
        """A 429 `insufficient_quota` now if `job`'s estimate would pass the key's budget; nothing is reserved (the
        job reserves when it runs: `admit`)."""
        key = who.key
        if key is None or not key.budget_usd or self.limiter is None:
            return
        try:
            await self.limiter.check_budget(key.name, key.budget_usd, key.budget_period, estimate_cost(cfg, job))
        except Limited as lim:
            raise _over(lim) from None
        except (OSError, RedisError) as exc:
            raise ApiError(
                503,
                f"The limits store is unavailable: {exc}",
                type="service_unavailable",
                code="key_store_unavailable",
                headers={"Retry-After": "5"},
            ) from None

    async def refresh(self, held: Reservation) -> None:
        if self.limiter is not None:
            await self.limiter.refresh(held)

    async def finish(self, who: Caller, admission: Admission, done: RequestCompleted, trace: Trace) -> None:
        """Charge a Redis key's token rate and budget (releasing its reservation) and hand `request.completed` to
        the outbox, which publishes it with a JetStream ack (and again after a NATS outage) while the answer
        goes on. The request's spans end here too."""
        key = who.key
        if key is not None and self.limiter is not None and (key.tpm or admission.held is not None):
            try:
                await self.limiter.charge(
                    key.name,
                    done.prompt_tokens + done.completion_tokens,
                    key.tpm,
                    done.cost_usd,
                    key.budget_period,
                    admission.held,
                )
            except Exception as exc:  # a lost charge must not fail an answered request
                log.warning("could not charge key %s: %s", key.name, exc)
        trace.end(done)
        self.outbox.put(done)
        if self.on_done is not None:  # the gateway's routing copy: the engine's load goes down
            self.on_done(done)
        log_completed(done)


def _over(lim: Limited) -> ApiError:
    code = "insufficient_quota" if "budget" in lim.what else "rate_limit_exceeded"
    return ApiError(
        429,
        f"Over this key's {lim.what}.",
        type="rate_limit_error",
        code=code,
        headers={"Retry-After": str(max(1, math.ceil(lim.retry_after_s)))},
    )


def log_completed(done: RequestCompleted) -> None:
    """The request's one line at INFO, as structured fields (JSON off a terminal): what an operator greps for a
    request id, without the metrics stack. The key's name only, never the key; no prompt, no answer."""
    log.info(
        "request completed",
        extra={
            "request_id": done.request_id,
            "fields": {
                "key_name": done.key_name,
                "model": done.model,
                "op": done.op,
                "status": done.status,
                "http_status": done.http_status,
                "stream": done.stream,
                "route": done.route_reason,
                "engine": done.engine_id,
                "engine_node": done.node_id,
                "parts": done.parts,
                "ttft_ms": None if done.ttft_s is None else round(done.ttft_s * 1000, 1),
                "total_ms": round(done.duration_s * 1000, 1),
                "prompt_tokens": done.prompt_tokens,
                "completion_tokens": done.completion_tokens,
                "client_request_id": done.client_request_id,
            },
        },
    )
