"""Logging: JSON lines off a terminal, readable text on one; every line carries request_id and node_id."""

from __future__ import annotations

import contextvars
import logging
import sys
import time

import msgspec

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("coderai_request_id", default="")

_static: dict[str, str] = {}
_secrets: set[str] = set()


def add_secret(value: str) -> None:
    """Never write `value` to a log: every line it would appear in shows `***` instead (settings.describe adds each
    secret-bearing setting and each URL's password at start)."""
    if value and len(value) >= 6:
        _secrets.add(value)


def redact(text: str) -> str:
    for value in _secrets:
        if value in text:
            text = text.replace(value, "***")
    return text


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = getattr(record, "request_id", None) or request_id_var.get()
        record.node_id = _static.get("node_id", "")
        record.service = _static.get("service", "")
        return True


def _context(record: logging.LogRecord, name: str) -> str | None:
    """A field `_ContextFilter` set on the record (LogRecord declares none of them)."""
    return getattr(record, name, None)


# a value JSON has no form for is written as its str(); lines are spaced as `json.dumps` spaces them (`"msg": ...`),
# at a quarter of its cost (the gateway writes one per request), with non-ASCII text as UTF-8, not escaped
_json = msgspec.json.Encoder(enc_hook=str)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        cached = record.__dict__.get("_coderai_json")
        if cached is not None:  # the ring's copy of what stderr got: the gateway logs a line per request
            return cached
        doc = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "service": _context(record, "service"),
            "node_id": _context(record, "node_id"),
            "request_id": _context(record, "request_id"),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if extra:
            doc.update(extra)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        text = record.__dict__["_coderai_json"] = redact(msgspec.json.format(_json.encode(doc), indent=0).decode())
        return text


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        t = time.strftime("%H:%M:%S", time.localtime(record.created))
        request_id = _context(record, "request_id")
        rid = f" [{request_id}]" if request_id else ""
        extra = getattr(record, "fields", None)
        tail = " " + " ".join(f"{k}={v}" for k, v in extra.items()) if extra else ""
        service = _context(record, "service")
        line = f"{t} {record.levelname[0]} {service}{rid} {record.getMessage()}{tail}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return redact(line)


class RingHandler(logging.Handler):
    """Keeps the last `capacity` formatted lines in memory, for `coderai.cmd.node.<id>.logs`."""

    def __init__(self, capacity: int = 2000) -> None:
        super().__init__()
        import collections

        self.lines: collections.deque[str] = collections.deque(maxlen=capacity)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # a log line must never break the caller
            self.handleError(record)

    def tail(self, n: int) -> list[str]:
        n = max(0, min(n, len(self.lines)))
        return list(self.lines)[-n:] if n else []


ring = RingHandler()


class _KnownNoise(logging.Filter):
    """asyncio warns "returning true from eof_received() has no effect when using ssl" each time a TLS connection
    to NATS closes (nats-py's protocol returns True there): two lines per service at every reconnect or stop, none
    of which an operator can act on. Every other asyncio warning is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("returning true from eof_received()")


_known_noise = _KnownNoise()


def setup_logging(service: str, node_id: str = "", level: str = "INFO", fmt: str = "auto") -> None:
    """Configure the root logger once per process."""
    _static.update(service=service, node_id=node_id)
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if use_json else TextFormatter())
    handler.addFilter(_ContextFilter())
    ring.setFormatter(JsonFormatter())
    ring.filters[:] = [_ContextFilter()]
    root = logging.getLogger()
    root.handlers[:] = [handler, ring]
    root.setLevel(level.upper())
    # libraries that log routine work at INFO: httpx one line per request, which is two lines a second per
    # llama-server engine (the worker polls its /metrics); the budget is docs/architecture.md's "Logs"
    for noisy in ("nats", "asyncio", "gguf", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    if _known_noise not in logging.getLogger("asyncio").filters:
        logging.getLogger("asyncio").addFilter(_known_noise)


def log_fields(**fields: object) -> dict[str, dict[str, object]]:
    """`logger.info("msg", extra=log_fields(a=1))` attaches structured fields to one line."""
    return {"fields": fields}
