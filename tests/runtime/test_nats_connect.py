"""Connecting to a TLS nats-server whose first connection stalls: the handshake taken and never answered, as a head's
nats-server does for seconds while it reloads its users (a node left, its WORK rights changed). nats-py makes no
other attempt after such a handshake times out; `nats_conn.connect` gives each attempt up after `ATTEMPT_S` and
makes another, so a worker restarted at that moment joins within its window, not after it (CI: a node restarted
just after it left lost its 10 s on the saved credentials). A real nats-server behind a proxy that holds the
first connection."""

from __future__ import annotations

import asyncio
import contextlib

from coderai.runtime import nats_conn
from coderai.runtime.embedded import NatsServer, free_port
from coderai.runtime.tls import client_context, ensure_certs


class HoldFirst:
    """A TCP proxy to `port` that takes its first connection and never answers it; later ones go through."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.connections = 0
        self._tasks: set[asyncio.Task] = set()
        self._held: list[asyncio.StreamWriter] = []

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.connections == 1:
            self._held.append(writer)  # read nothing, answer nothing, close nothing
            return
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        for t in (asyncio.create_task(pipe(reader, up_w)), asyncio.create_task(pipe(up_r, writer))):
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        for w in self._held:
            w.close()
        for t in list(self._tasks):
            t.cancel()
        self._server.close()


async def test_a_stalled_tls_handshake_is_given_up_and_the_next_attempt_connects(tmp_path):
    certs = ensure_certs(tmp_path / "tls", ["127.0.0.1", "localhost"])
    server = NatsServer(tmp_path / "nats", port=free_port(), tls=certs).start()
    proxy = HoldFirst(int(server.url.rsplit(":", 1)[1]))
    try:
        port = await proxy.start()
        nc = await nats_conn.connect(
            f"nats://127.0.0.1:{port}", "test", connect_timeout_s=10, tls=client_context(certs.ca_pem)
        )
        try:
            assert nc.is_connected and proxy.connections >= 2  # the held one, then one that went through
            await nc.flush(timeout=5)
        finally:
            await nc.close()
    finally:
        await proxy.close()
        server.stop()
