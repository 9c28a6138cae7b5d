"""A span exporter that appends one JSON line per finished span to a file (`CODERAI_TRACE_FILE`).

Imported only when that variable is set. Each line is written with a single `write` on a file opened for
appending, so processes sharing one file (granian's workers) do not interleave within a line.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def span_record(span: ReadableSpan, service: str) -> dict[str, Any]:
    """One finished span as plain JSON-able data: ids in lowercase hex as in `traceparent`, times in ns."""
    ctx = span.context
    assert ctx is not None  # every span the SDK finishes has one (None only for a ReadableSpan built by hand)
    parent = span.parent
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name,
        "service": service,
        "kind": span.kind.name.lower(),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name.lower(),
        "status_message": span.status.description or "",
        "attributes": dict(span.attributes or {}),
    }


class JsonLinesExporter(SpanExporter):
    """Appends `span_record` lines to `path` (its folder is created), flushed after every export."""

    def __init__(self, path: str, service: str) -> None:
        self.path = path
        self.service = service
        self._lock = threading.Lock()
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(s, self.service), default=str) + "\n" for s in spans).encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            os.write(self._fd, data)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
