"""A recording HTTP proxy for tests: a client (Open WebUI) talks to it as if it were the gateway; it forwards every
request unchanged, streams the answer back as it comes, and keeps what was sent and what came back.

What it records is what a replay test needs: method, path with query, the request headers that say something about
the request (credentials and hop-by-hop headers left out), the body (JSON decoded where it is JSON), and the answer's
status, content type and first bytes."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

# Credentials never reach a recording; hop-by-hop and per-connection headers say nothing about the request.
DROPPED_HEADERS = {
    "authorization",
    "x-api-key",
    "cookie",
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "accept-encoding",
    "te",
    "upgrade",
    "proxy-authorization",
}
ANSWER_BYTES = 4096  # enough of an answer to read its shape in a recording, small enough to commit


def body_for_record(raw: bytes, content_type: str) -> Any:
    """JSON bodies as JSON; anything else as `{"base64": ...}` (an upload) or None when empty."""
    if not raw:
        return None
    if "json" in content_type or raw[:1] in (b"{", b"["):
        try:
            return json.loads(raw)
        except ValueError:
            pass
    return {"base64": base64.b64encode(raw).decode()}


def body_from_record(body: Any) -> bytes:
    """The bytes `body_for_record` kept."""
    if body is None:
        return b""
    if isinstance(body, dict) and set(body) == {"base64"}:
        return base64.b64decode(body["base64"])
    return json.dumps(body).encode()


class RecordingProxy:
    """On a random loopback port (`url`), forwarding to `upstream`; `exchanges` grows by one dict per request."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._client = httpx.Client(timeout=httpx.Timeout(600, connect=10))
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def pending(self) -> int:
        """Requests whose answer has not ended yet."""
        with self._lock:
            return sum("response" not in e for e in self.exchanges)

    def take(self) -> list[dict[str, Any]]:
        """The exchanges so far, in the order their requests arrived; the list is emptied."""
        with self._lock:
            out, self.exchanges = self.exchanges, []
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._client.close()


def _handler(proxy: RecordingProxy):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the answer ends when the socket closes: streams pass through unframed

        def log_message(self, *_a) -> None:
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            # identity answers, so the recorded head is readable
            headers = {
                k: v
                for k, v in self.headers.items()
                if k.lower() not in {"host", "connection", "keep-alive", "accept-encoding"}
            }
            record: dict[str, Any] = {
                "method": self.command,
                "path": self.path,
                "headers": {k.lower(): v for k, v in self.headers.items() if k.lower() not in DROPPED_HEADERS},
                "body": body_for_record(raw, self.headers.get("Content-Type", "")),
            }
            with proxy._lock:
                proxy.exchanges.append(record)
            req = proxy._client.build_request(self.command, proxy.upstream + self.path, headers=headers, content=raw)
            try:
                resp = proxy._client.send(req, stream=True)
            except httpx.HTTPError as e:
                record["response"] = {"status": 502, "error": str(e)}
                self.send_error(502, str(e))
                return
            head = bytearray()
            try:
                self.send_response(resp.status_code)
                for k, v in resp.headers.multi_items():
                    if k.lower() not in {"content-length", "transfer-encoding", "connection"}:
                        self.send_header(k, v)
                self.send_header("Connection", "close")
                self.end_headers()
                for chunk in resp.iter_raw():
                    if len(head) < ANSWER_BYTES:
                        head += chunk[: ANSWER_BYTES - len(head)]
                    self.wfile.write(chunk)
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client left; the record keeps what came back until then
            finally:
                resp.close()
                record["response"] = {
                    "status": resp.status_code,
                    "content_type": resp.headers.get("content-type", ""),
                    "head": head.decode(errors="replace"),
                }

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _forward

    return H
