"""The broker's loopback relay to RunPod serverless endpoints, the one place that holds the RunPod key for them.

A relay node (a `remote` engine the broker supervises, `serverless.py`) sends its model's chat and completion
requests to `http://127.0.0.1:<port>/<relay name>/v1/...` with a token of its own; this proxy checks the token,
reserves the request's price under the model's caps (`Meter.reserve`: the `over_budget` a pod would get, before
anything is sent), forwards it to `<base>/v2/<endpoint id>/openai/v1/...` with the RunPod key (RunPod's vLLM worker
route, https://docs.runpod.io/serverless/vllm/openai-compatibility), relays the answer as it comes (a stream stays
a stream), and books what it cost (`Meter.settle`) before the answer's last byte, so the node's client sees the
end only once the spend is in Redis. `GET .../v1/models` is answered here from the endpoint's `/health` (no worker
is woken for it).

What RunPod sends back is input from the internet: at most `max_bytes` per answer (then the connection is cut: the
remote engine says the answer was cut), for at most the policy's `serverless_max_s` (then cut too, and billed to
there); a request body past MAX_REQUEST is refused. Nothing here logs a key or a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import h11
import httpx

from coderai.contracts import BusError

log = logging.getLogger("coderai.pod_broker.serverless")

MAX_REQUEST = 32 << 20
MAX_HEAD = 64 << 10
READ_S = 30.0  # a request's head and body must arrive within this
ROUTES = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True)
class Route:
    """One relay: its name (the relay node's id), the token its node sends, the endpoint it reaches."""

    name: str
    model: str
    token: str
    endpoint: str
    served_model: str
    max_s: float
    max_bytes: int


class Meter(Protocol):
    async def reserve(self, route: Route) -> Any:
        """Reserve one request's price under the caps; BusError `over_budget` when a cap refuses it."""
        ...

    async def settle(self, route: Route, ticket: Any, start: float, end: float, sent: bool) -> None:
        """Book the request (`sent`: it reached RunPod) or release its reservation (it never did)."""
        ...


class Cut(Exception):
    """The answer went past `max_bytes` or `max_s`."""


class Proxy:
    def __init__(self, base_url: str, api_key: str, meter: Meter) -> None:
        self.base = base_url.rstrip("/")
        self._key = api_key
        self.meter = meter
        self.routes: dict[str, Route] = {}
        self.url = ""
        self._server: asyncio.Server | None = None
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None), follow_redirects=False)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._http.aclose()

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._key}"}

    async def health(self, endpoint: str) -> dict:
        """The endpoint's `/health` (https://docs.runpod.io/serverless/endpoints/operation-reference); BusError
        `no_engine` (retryable) when it cannot be read or says no worker can run."""
        why = ""
        try:
            r = await self._http.get(f"{self.base}/v2/{endpoint}/health", headers=self._auth(), timeout=10.0)
            if r.status_code != 200:
                why = f"/health answered {r.status_code}"
            else:
                body = r.json()
                workers = body.get("workers") if isinstance(body, dict) else None
                if not isinstance(workers, dict):
                    why = "/health answered no workers"
                else:
                    n = {k: v for k, v in workers.items() if isinstance(v, int)}
                    up = sum(n.get(k, 0) for k in ("idle", "ready", "running", "initializing"))
                    if not up and n.get("unhealthy", 0) + n.get("throttled", 0):
                        why = f"every worker is unhealthy or throttled ({n})"
                    else:
                        return body
        except (httpx.HTTPError, ValueError) as exc:
            why = f"/health failed ({type(exc).__name__})"
        raise BusError("no_engine", f"RunPod serverless endpoint {endpoint}: {why}", retryable=True)

    # --- serving --------------------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        out = _Out(conn, writer)
        try:
            try:
                async with asyncio.timeout(READ_S):
                    req, body = await _read(conn, reader)
            except (h11.RemoteProtocolError, TimeoutError, _TooBig) as exc:
                status = 413 if isinstance(exc, _TooBig) else 408 if isinstance(exc, TimeoutError) else 400
                return await out.error(status, "bad_request", f"bad request ({type(exc).__name__})")
            if req is None:
                return
            await self._dispatch(out, req, body)
        except (ConnectionError, h11.LocalProtocolError):
            pass  # the node went away, or its answer was cut
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _dispatch(self, out: _Out, req: h11.Request, body: bytes) -> None:
        target = req.target.decode("latin-1").split("?", 1)[0]
        name, _, path = target.lstrip("/").partition("/")
        route = self.routes.get(name)
        if route is None:
            return await out.error(404, "not_found", "no such relay")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in req.headers}
        if not hmac.compare_digest(headers.get("authorization", ""), f"Bearer {route.token}"):
            return await out.error(401, "unauthorized", "wrong token")
        path = "/" + path
        if req.method == b"GET" and path == "/v1/models":
            try:
                await self.health(route.endpoint)
            except BusError as exc:
                return await out.error(503, exc.code, exc.message)
            return await out.json(200, {"object": "list", "data": [{"id": route.served_model, "object": "model"}]})
        if req.method != b"POST" or path not in ROUTES:
            return await out.error(404, "not_found", f"no route {req.method.decode('latin-1')} {path}")
        try:
            ticket = await self.meter.reserve(route)
        except BusError as exc:
            return await out.error(429, exc.code, exc.message)
        await self._forward(out, route, ticket, path, body, headers.get("content-type") or "application/json")

    async def _forward(self, out: _Out, route: Route, ticket: Any, path: str, body: bytes, ctype: str) -> None:
        url = f"{self.base}/v2/{route.endpoint}/openai{path}"
        start, sent, size = time.time(), False, 0
        try:
            async with asyncio.timeout(route.max_s):
                async with self._http.stream(
                    "POST", url, content=body, headers={**self._auth(), "Content-Type": ctype}
                ) as r:
                    sent = True
                    await out.head(r.status_code, r.headers.get("content-type") or "application/json")
                    async for chunk in r.aiter_bytes():
                        size += len(chunk)
                        if size > route.max_bytes:
                            raise Cut(f"an answer over {route.max_bytes >> 20} MB")
                        await out.data(chunk)
        except TimeoutError:
            log.warning("relay %s: endpoint %s ran past %gs; cut", route.name, route.endpoint, route.max_s)
            await self.meter.settle(route, ticket, start, time.time(), sent)
            return await out.error(504, "timeout", f"RunPod serverless ran past {route.max_s:g} s")
        except Cut as exc:
            log.warning("relay %s: endpoint %s sent %s; cut", route.name, route.endpoint, exc)
            await self.meter.settle(route, ticket, start, time.time(), sent)
            return  # the connection closes without the answer's end: the node's client says it was cut
        except httpx.HTTPError as exc:
            await self.meter.settle(route, ticket, start, time.time(), sent)
            return await out.error(502, "engine_failed", f"RunPod serverless failed ({type(exc).__name__})")
        except BaseException:
            await self.meter.settle(route, ticket, start, time.time(), sent)
            raise
        await self.meter.settle(route, ticket, start, time.time(), sent)
        await out.end()


class _TooBig(Exception):
    pass


async def _read(conn: h11.Connection, reader: asyncio.StreamReader) -> tuple[h11.Request | None, bytes]:
    req: h11.Request | None = None
    parts: list[bytes] = []
    size = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(65536))
        elif isinstance(event, h11.Request):
            req = event
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size > MAX_REQUEST:
                raise _TooBig()
            parts.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return req, b"".join(parts)
        else:  # closed before a whole request
            return None, b""


class _Out:
    """The answer to the node, over h11 (chunked when no length is given: a stream stays a stream)."""

    def __init__(self, conn: h11.Connection, writer: asyncio.StreamWriter) -> None:
        self.conn, self.writer, self.started = conn, writer, False

    async def _send(self, event: Any) -> None:
        data = self.conn.send(event)
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def head(self, status: int, ctype: str) -> None:
        self.started = True
        headers = [(b"content-type", ctype.encode("latin-1")), (b"connection", b"close")]
        await self._send(h11.Response(status_code=status, headers=headers))

    async def data(self, chunk: bytes) -> None:
        await self._send(h11.Data(data=chunk))

    async def end(self) -> None:
        await self._send(h11.EndOfMessage())

    async def json(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        await self._send(
            h11.Response(
                status_code=status,
                headers=[
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                    (b"connection", b"close"),
                ],
            )
        )
        await self.data(data)
        await self.end()

    async def error(self, status: int, code: str, message: str) -> None:
        if not self.started:  # past the head, the connection just closes: the answer is cut
            await self.json(status, {"error": {"message": message, "code": code}})
