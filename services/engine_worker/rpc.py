"""This node's ggml RPC server (llama.cpp's `rpc-server`), behind a gate that lets in only the nodes serving split
models here.

ggml RPC has no authentication at all: whoever connects can read and write the device's memory. So:
- the server runs only while a split is placed on this node (the scheduler names its peers in this node's
  assignment, `rpc_peers`), on a fresh loopback port each time, and is stopped when no split needs it;
- the address other nodes see is a small TCP relay here, bound to the cluster interface, that accepts a
  connection only from an address the scheduler named and closes every other at once, and drops a peer's
  open relays the moment the scheduler stops naming it;
- it relays nothing until the peer sends its first byte, so the serving node's liveness probe (connect, close)
  costs the server nothing. Binding the gate to every interface (`0.0.0.0`, `::`) is refused unless explicitly
  allowed.
What this does not protect: a peer the scheduler named (the node serving the split) can do anything the protocol
allows to this node's RPC device while it is named, and the link itself is not encrypted (docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading

from coderai.contracts.split import RpcServer
from coderai.runtime.embedded import die_with_parent, free_port

log = logging.getLogger("coderai.engine_worker.rpc")

ANY = ("0.0.0.0", "::", "")
CHUNK = 1 << 16
LINK_PROBE = b"CODERAI-LINK-PROBE\n"  # ggml RPC's first byte is a small command number, never "C"
PROBE_BYTES = 4 << 20
UPSTREAM_WAIT_S = 30.0


class RpcConfigError(ValueError):
    """The RPC server may not be bound where the settings ask."""


def cluster_address(nats_url: str) -> str:
    """The local address this machine uses to reach the bus: the cluster interface (no packet is sent)."""
    from urllib.parse import urlparse

    u = urlparse(nats_url.split(",")[0])
    host, port = u.hostname or "127.0.0.1", u.port or 4222
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def gate_address(bind: str, nats_url: str, allow_any: bool) -> str:
    addr = bind or cluster_address(nats_url)
    if addr in ANY and not allow_any:
        raise RpcConfigError(
            "refusing to offer the RPC server on every interface: ggml RPC has no authentication. Bind it to the "
            "cluster interface (CODERAI_WORKER_RPC_BIND) or set CODERAI_WORKER_RPC_ALLOW_ANY=true"
        )
    return addr


class RpcGate:
    """Accepts peers from the allow-list and relays their bytes to the loopback RPC server.

    Plain threads with blocking sockets, not the worker's event loop: every token of a split model crosses the
    gate twice in small messages, and a thread woken by the kernel relays them sooner than an event loop that
    is also busy with the bus (TCP_NODELAY on both legs, as ggml sets on its own)."""

    def __init__(self, host: str, port: int, upstream_port: int) -> None:
        self.host, self.port, self.upstream_port = host, port, upstream_port
        self.allowed: frozenset[str] = frozenset()
        self.refused = 0
        self._sock: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._peers: dict[socket.socket, str] = {}  # each relayed connection's peer address
        self._lock = threading.Lock()
        self.upstream_ready = threading.Event()  # set while a server listens behind the gate
        if upstream_port:
            self.upstream_ready.set()

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._sock = socket.create_server((self.host, self.port), family=family, backlog=16)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept_loop, name=f"rpc-gate-{self.port}", daemon=True).start()

    def allow(self, peers: list[str]) -> None:
        new = frozenset(peers)
        if new != self.allowed:
            log.info("RPC gate on %s:%d admits %s", self.host, self.port, sorted(new) or "nobody")
        self.allowed = new
        with self._lock:
            gone = [c for c, peer in self._peers.items() if peer not in new]
        for c in gone:  # a node no longer named loses what it had open at once, not at its next connect
            _close(c)

    def drop_relays(self) -> None:
        """Close every relayed connection (the server behind the gate is going)."""
        with self._lock:
            conns = list(self._peers)
        for c in conns:
            _close(c)

    async def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
            self._sock.close()
        with self._lock:
            conns, self._open = list(self._open), set()
        for c in conns:
            _close(c)

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed
            if addr[0] not in self.allowed:
                self.refused += 1
                log.warning("RPC gate refused %s: not a node serving a split model here", addr[0])
                _close(conn)
                continue
            threading.Thread(target=self._serve, args=(conn, addr[0]), name=f"rpc-gate-{addr[0]}", daemon=True).start()

    def _track(self, *socks: socket.socket) -> None:
        with self._lock:
            self._open.update(socks)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        up = None
        self._track(conn)
        with self._lock:
            self._peers[conn] = peer
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            first = conn.recv(CHUNK)
            if not first:  # a liveness probe: connected and left
                return
            if first.startswith(LINK_PROBE):  # a link-speed probe: swallow the bytes, say how many came
                got = len(first) - len(LINK_PROBE)
                while data := conn.recv(CHUNK):
                    got += len(data)
                conn.sendall(got.to_bytes(8, "big"))
                return
            # a peer named a moment before its server was started waits for it (bounded)
            if not self.upstream_ready.wait(UPSTREAM_WAIT_S) or peer not in self.allowed:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._track(up)
            up.sendall(first)
            back = threading.Thread(target=_pipe, args=(up, conn), daemon=True)
            back.start()
            _pipe(conn, up)
            back.join()
        except OSError:
            pass
        finally:
            for c in (conn, up):
                if c is not None:
                    with self._lock:
                        self._open.discard(c)
                        self._peers.pop(c, None)
                    _close(c)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Bytes from `src` to `dst` until `src` ends; then end `dst`'s sending side too."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    try:
        while n := src.recv_into(buf):
            dst.sendall(view[:n])
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.close()


def link_gbps(endpoint: str, nbytes: int = PROBE_BYTES, timeout_s: float = 10.0) -> float:
    """A short probe of the link to a node's RPC gate: `nbytes` sent, timed until the gate says it has them
    all. 0.0 when the gate cannot be reached or answers short. Blocking."""
    import time

    host, _, port = endpoint.rpartition(":")
    payload = LINK_PROBE + bytes(nbytes)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as s:
            t0 = time.perf_counter()
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            answer = b""
            while len(answer) < 8 and (data := s.recv(8 - len(answer))):
                answer += data
            elapsed = time.perf_counter() - t0
    except OSError:
        return 0.0
    if len(answer) < 8 or int.from_bytes(answer, "big") != nbytes:
        return 0.0
    return nbytes * 8 / elapsed / 1e9


def find_rpc_server() -> str | None:
    """llama.cpp's `rpc-server`: `CODERAI_RPC_SERVER`, the one beside this interpreter (`scripts/setup` builds it
    into `.venv/bin` from the source and flags of `llama-server`, so both ends speak one protocol version), or one
    on PATH."""
    named = os.environ.get("CODERAI_RPC_SERVER")
    if named:
        return named
    beside = os.path.join(os.path.dirname(sys.executable), "rpc-server")
    return beside if os.path.exists(beside) else shutil.which("rpc-server")


class RpcService:
    """The gate, always open on its port, and llama.cpp's `rpc-server` behind it, which runs only while a split
    is placed here: started on a fresh loopback port when the scheduler first names a peer (`admit`), stopped
    when it names none. `info()` is what the heartbeat announces."""

    def __init__(self, host: str, port: int, threads: int = 0) -> None:
        self.host, self.port, self.threads = host, port, threads
        self.proc: subprocess.Popen[bytes] | None = None
        self.gate: RpcGate | None = None
        self.device = "CPU"
        self.binary = find_rpc_server()

    async def start(self) -> None:
        if self.binary is None:
            raise RuntimeError(
                "rpc-server not found: run scripts/setup (it builds .venv/bin/rpc-server beside llama-server), "
                "or set CODERAI_RPC_SERVER to its path"
            )
        self.gate = RpcGate(self.host, self.port, 0)
        await self.gate.start()
        log.info("RPC gate (%s) offered on %s:%d", self.device, self.host, self.gate.port)

    async def admit(self, peers: list[str]) -> None:
        """Let `peers` in: the server is started when there are some and it was not running, and stopped when
        there are none."""
        assert self.gate is not None, "started"
        self.gate.allow(peers)  # a peer that connects before the server listens is held until it does
        if peers and (self.proc is None or self.proc.poll() is not None):
            await self._start_server()
        if not peers and self.proc is not None:
            await self._stop_server()

    async def tend(self) -> None:
        """Start the server again if it died while a split is placed here (each heartbeat asks)."""
        if self.gate is not None and self.gate.allowed and self.proc is not None and self.proc.poll() is not None:
            log.warning(
                "RPC server exited with %s while a split is placed here: starting it again", self.proc.returncode
            )
            await self._stop_server()
            await self._start_server()

    async def _start_server(self) -> None:
        assert self.binary is not None and self.gate is not None
        inner = free_port()
        cmd = [self.binary, "--host", "127.0.0.1", "--port", str(inner)]
        cmd += ["--threads", str(self.threads or max(1, os.cpu_count() or 1))]
        # started on the event loop's thread, which lives as long as the worker: the server dies with the worker
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent(),
        )
        await until_listening(inner, self.proc)
        self.gate.upstream_port = inner
        self.gate.upstream_ready.set()
        log.info("RPC server started for a split on loopback port %d (pid %d)", inner, self.proc.pid)

    async def _stop_server(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if self.gate is not None:
            self.gate.upstream_ready.clear()
            self.gate.upstream_port = 0
            self.gate.drop_relays()
        if proc.poll() is None:
            proc.kill()
        await asyncio.get_running_loop().run_in_executor(None, proc.wait)
        log.info("RPC server stopped")

    def info(self, mem_total: int, mem_free: int) -> RpcServer:
        assert self.gate is not None
        return RpcServer(
            endpoint=f"{self.host}:{self.gate.port}", device=self.device, mem_total=mem_total, mem_free=mem_free
        )

    async def close(self) -> None:
        if self.gate is not None:
            await self.gate.close()
        await self._stop_server()


async def until_listening(port: int, proc: subprocess.Popen, deadline_s: float = 30.0, host: str = "127.0.0.1") -> None:
    """Wait (bounded) until the server just started on `host:port` accepts a connection."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the RPC server exited with {proc.returncode}")
        try:
            _, w = await asyncio.open_connection(host, port)
        except OSError:
            if loop.time() > end:
                raise RuntimeError("the RPC server did not listen within 30 s") from None
            await asyncio.sleep(0.05)
            continue
        w.close()  # a connect that sends nothing: the server drops it and waits for the next client
        return
