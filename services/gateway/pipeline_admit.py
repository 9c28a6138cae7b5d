"""The pipeline's first stage: admission. The key's allow-list, the model (serving the op), the job shaped by the
model's and the key's limits (output tokens, stop sequences, priority, keep-alive, cache scope), a body the bus can
carry, then the key's budget, whose reservation is kept fresh while the call runs.

`Call.admit` runs `admit`; the job shaping is plain functions over the job and its model's config.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import msgspec

from coderai.accounts.keys import ApiKey
from coderai.accounts.limits import REFRESH_EVERY_S, Reservation
from coderai.contracts import ModelConfig
from coderai.contracts.jobs import BACKGROUND, INTERACTIVE
from coderai.gateway import affinity
from coderai.gateway.accounting import NO_TRACE, allowed
from coderai.gateway.pricing import checked_work
from coderai.gateway.bounds import check_lora_scale, check_schemas
from coderai.gateway.errors import ApiError
from coderai.gateway.http import priority_var
from coderai.router.picking import keys_to_record

if TYPE_CHECKING:
    from coderai.gateway.pipeline import Call

log = logging.getLogger("coderai.gateway")

HEADROOM = 4096  # bytes of a bus message kept for its subject, reply and headers


def output_limited(job: Any, cfg: ModelConfig, key: ApiKey | None = None) -> Any:
    """`job` with the model's and the key's output limits applied: the key's `default_output_tokens` (else the
    model's) when the request names none, capped at the lower of their `max_output_tokens`, and the model's `stop`
    sequences added to the request's own."""
    want = job.params.max_tokens
    default = (key.default_output_tokens if key else 0) or cfg.default_output_tokens
    if want is None and default > 0:
        want = default
    ceiling = min([c for c in (cfg.max_output_tokens, key.max_output_tokens if key else 0) if c > 0], default=0)
    if ceiling > 0 and (want is None or want > ceiling):
        want = ceiling
    stop = list(job.params.stop) + [s for s in cfg.stop if s and s not in job.params.stop]
    if want == job.params.max_tokens and stop == job.params.stop:
        return job
    return msgspec.structs.replace(job, params=msgspec.structs.replace(job.params, max_tokens=want, stop=stop))


# what a UI's background task begins its prompt with: Open WebUI's title, tags, follow-up, query and autocomplete
# tasks all open with this heading
TASK_MARKERS = ("### Task:",)


def prioritised(job: Any, header: int | None) -> Any:
    """`job` with its priority: the request's header's, else BACKGROUND for a UI's background task (its last user
    message opens with a task marker), else interactive as it came."""
    priority = header
    if priority is None:
        last = next((m for m in reversed(getattr(job, "messages", None) or []) if m.get("role") == "user"), None)
        text = _first_text(last.get("content")) if last else ""
        priority = BACKGROUND if text.lstrip().startswith(TASK_MARKERS) else INTERACTIVE
    return job if priority == job.priority else msgspec.structs.replace(job, priority=priority)


def _first_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    for part in content if isinstance(content, list) else []:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            return part["text"]
    return ""


TENANT_KEEP_ALIVE_MAX_S = 3600.0  # the longest a tenant's keep_alive holds a model, unless the model's own is longer


def tenant_keep_alive(cfg: ModelConfig, asked: float, own: bool = False) -> float | None:
    """What a key without the admin scope may ask of Ollama's `keep_alive`: to keep the model loaded a while, up to
    the longer of the model's own idle time and an hour. Never to unload it (0: other tenants may be using it),
    unless the model is its `own` (a fine-tuned model no other key can use), nor to pin it for good (< 0); either
    is taken as not asked, and the model keeps its own policy."""
    if asked == 0 and own:
        return 0.0
    if asked <= 0:
        return None
    idle = cfg.keep_alive()
    return min(asked, max(TENANT_KEEP_ALIVE_MAX_S, idle if idle is not None else 0.0))


async def admit(call: Call) -> ModelConfig:
    """The model (serving this op), a body the bus can carry, then the key's limits: nothing is reserved for
    a request refused by the first two."""
    allowed(call.who, call.job.model)  # first: a model outside the key's allow-list is as absent as a missing one
    cfg = await call.gw.find_model(call.job.model, call.op)
    allowed(call.who, cfg.name, cfg.owner)  # another key's fine-tuned model is as absent, too
    if call.keep_alive_s is not None and "admin" not in call.who.scopes:
        call.keep_alive_s = tenant_keep_alive(
            cfg, call.keep_alive_s, own=bool(cfg.owner) and cfg.owner == call.who.key_name
        )
    key = call.who.key
    if call.spec.llm and (
        cfg.default_output_tokens
        or cfg.max_output_tokens
        or cfg.stop
        or (key is not None and (key.default_output_tokens or key.max_output_tokens))
    ):
        call.job = output_limited(call.job, cfg, key)
    if call.spec.llm and hasattr(call.job, "priority"):
        call.job = prioritised(call.job, priority_var.get())
    if call.spec.llm:
        scope_cache(call, cfg)
        check_schemas(call.job)  # a grammar's cost grows with its schema's nesting: bounded before it is built
        check_lora_scale(call.job, cfg)
    if not call.spec.llm:  # an image's or video's pixels x steps within the model's limits, priced before any GPU works
        call.work = checked_work(cfg, call.job)
    if not call.spec.blobs:  # measured by encoding it once: the bytes are what is sent
        call.encoded = check_size(call, call.job)
    call.admission = await call.gw.accounts.admit(call.who, cfg, call.job)
    call.admitted = True
    if call.trace is not NO_TRACE:
        call.trace.start(
            call.spec.span,
            request_id=call.job.request_id,
            model=call.job.model,
            op=call.op,
            key_name=call.who.key_name,
            stream=call.streamed,
        )
    if call.admission.held is not None:
        call._refresher = asyncio.create_task(_refresh(call, call.admission.held))
    return cfg


CACHE_REPORTING = frozenset({"vllm"})
"""Engine families whose workers say when their cache dropped a prompt (vLLM's KV events): their jobs carry the
affinity keys, so the router forgets a conversation's engine once it no longer holds the conversation."""


def scope_cache(call: Call, cfg: ModelConfig) -> None:
    """Unless this key may share the model's prompt cache, its affinity keys and its job carry the key's scope:
    the router never sends it after another key's prefix, nor does an engine serve it from one. A job for an engine
    that reports its cache carries the keys its pick is remembered under (`CACHE_REPORTING`)."""
    key = call.who.key
    scope = affinity.cache_scope(
        call.who.key_name, cfg.share_cache, key.share_cache if key else None, call.gw.settings.share_cache
    )
    if scope:
        call.route = affinity.scoped(call.route, scope)
        if hasattr(call.job, "cache_scope"):
            call.job = msgspec.structs.replace(call.job, cache_scope=scope)
    if cfg.engine in CACHE_REPORTING and hasattr(call.job, "cache_keys"):
        keys = keys_to_record(call.route)  # what the pick is remembered under, scoped as the router sees them
        if keys:
            call.job = msgspec.structs.replace(call.job, cache_keys=keys)


def check_size(call: Call, job: Any) -> bytes:
    """The job encoded for the bus; over what one message carries it is the client's 413, not a 500 from the
    publish."""
    data = call.spec.subject.encode(job)
    limit = call.gw.bus.nc.max_payload - HEADROOM
    if len(data) > limit:
        raise ApiError(
            413,
            f"The request is too large: {len(data)} bytes of job, and one message carries at most {limit}.",
            code="request_too_large",
        )
    return data


async def _refresh(call: Call, held: Reservation) -> None:
    while True:
        await asyncio.sleep(REFRESH_EVERY_S)
        try:
            await call.gw.accounts.refresh(held)
        except Exception as exc:  # Redis blinked: the next tick tries again
            log.warning("could not refresh the budget reservation of %s: %s", call.job.request_id, exc)
