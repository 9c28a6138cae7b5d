"""OpenTelemetry tracing, off unless asked for: one trace per request across gateway, router and worker.

Tracing is on in a process only when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set,
which exports over OTLP/HTTP in batches, or `CODERAI_TRACE_FILE` is set, which writes one JSON line per finished
span (`{service}` in the path becomes the service name, so each process has its own file). Spans cross the bus in
the W3C `traceparent` header (`HDR_TRACEPARENT`).

While it is off, nothing here imports OpenTelemetry: `start_span` returns the shared `NO_SPAN`, whose methods do
nothing, and `inject` hands back the headers it was given. Call sites that would build attribute dicts check
`enabled()` first, so the request path pays one function call.

Spans are passed explicitly (`parent=`, `headers=`) rather than through a current-span context: a streamed
response outlives the handler that started its span, and explicit parents survive that without attach/detach.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from coderai.contracts.topology import HDR_TRACEPARENT

log = logging.getLogger("coderai.tracing")

ENV_TRACE_FILE = "CODERAI_TRACE_FILE"
ENV_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
OTLP_PACKAGE = "opentelemetry-exporter-otlp-proto-http"

_enabled = False
_service = ""
_tracer: Any = None
_provider: Any = None
_propagator: Any = None
_kinds: dict[str, Any] = {}


class _NoSpan:
    """What every helper returns while tracing is off: a span that records nothing."""

    __slots__ = ()

    def __enter__(self) -> "_NoSpan":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        return None

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        return None

    def is_recording(self) -> bool:
        return False

    def end(self, end_time: int | None = None) -> None:
        return None


NO_SPAN: Any = _NoSpan()


def enabled() -> bool:
    """True when this process records spans (`setup_tracing` found an exporter to use)."""
    return _enabled


def setup_tracing(service_name: str, node_id: str = "") -> bool:
    """Turn tracing on for this process if the environment asks for it; True if it is on. Call it once per
    process, before serving (later calls change nothing)."""
    global _enabled, _service, _tracer, _provider, _propagator
    if _provider is not None:
        return _enabled
    trace_file = os.environ.get(ENV_TRACE_FILE, "")
    endpoint = os.environ.get(ENV_OTLP_TRACES_ENDPOINT) or os.environ.get(ENV_OTLP_ENDPOINT, "")
    if not trace_file and not endpoint:
        return False

    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    attrs = {"service.name": service_name, "service.namespace": "coderai"}
    if node_id:
        attrs["coderai.node_id"] = node_id
    provider = TracerProvider(resource=Resource.create(attrs))  # sampler from OTEL_TRACES_SAMPLER, if set
    exporters = 0
    if trace_file:
        from coderai.runtime.trace_file import JsonLinesExporter

        path = trace_file.replace("{service}", service_name)
        # one synchronous write per span: a test (or a person with tail -f) reads it right after the request
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path, service_name)))
        exporters += 1
    if endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning(
                "%s is set but %s is not installed; spans are not exported to %s (pip install %s, or coderai[otel])",
                ENV_OTLP_ENDPOINT,
                OTLP_PACKAGE,
                endpoint,
                OTLP_PACKAGE,
            )
        else:
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # reads the OTEL_* variables itself
            exporters += 1
    _provider = provider
    if not exporters:
        return False
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):  # libraries' own spans join ours
        trace.set_tracer_provider(provider)
    _tracer = provider.get_tracer("coderai")
    _propagator = TraceContextTextMapPropagator()
    _kinds.update(server=trace.SpanKind.SERVER, client=trace.SpanKind.CLIENT, internal=trace.SpanKind.INTERNAL)
    _service = service_name
    _enabled = True
    log.info("tracing on", extra={"fields": {"trace_file": path if trace_file else "", "otlp_endpoint": endpoint}})
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporters, and turn tracing off (tests; the provider also flushes at exit)."""
    global _enabled, _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _enabled, _tracer, _provider = False, None, None


def start_span(
    name: str,
    *,
    parent: Any = None,
    headers: Mapping[str, str] | None = None,
    kind: str = "internal",
    attributes: Mapping[str, Any] | None = None,
) -> Any:
    """Start a span, to be ended with `.end()` or used as a context manager (which records an exception).

    Its parent is `parent` (a span from here) or else the `traceparent` in `headers` (a message from the bus);
    with neither it starts a new trace. Returns `NO_SPAN` while tracing is off.
    """
    if not _enabled:
        return NO_SPAN
    from opentelemetry import trace

    if parent is not None and parent is not NO_SPAN:
        ctx = trace.set_span_in_context(parent)
    elif headers and HDR_TRACEPARENT in headers:
        ctx = _propagator.extract(headers)
    else:
        ctx = None
    return _tracer.start_span(name, context=ctx, kind=_kinds[kind], attributes=attributes)


def inject(span: Any, headers: dict[str, str]) -> dict[str, str]:
    """`headers` plus the `traceparent` that makes the receiver's spans children of `span`; the same dict,
    untouched, when `span` records nothing."""
    if span is NO_SPAN or not span.is_recording():
        return headers
    from opentelemetry import trace

    out = dict(headers)
    _propagator.inject(out, context=trace.set_span_in_context(span))
    return out


def set_error(span: Any, description: str) -> None:
    """Mark `span` failed (status ERROR with `description`)."""
    if span is NO_SPAN:
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, description))
