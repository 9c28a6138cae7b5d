"""Raw TCP clients for abuse tests: many idle connections opened without blocking, a request sent byte for byte
as given, and a count of the files a service process holds open."""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import struct
import time
from pathlib import Path
from typing import cast

from coderai.testing.procs import ServiceProcess, deadline_scale


def open_fds(proc: ServiceProcess) -> int:
    """Open files of a gateway: the process started and granian's workers (its children hold the sockets)."""
    assert proc.proc is not None, f"{proc.name} was never started"
    parent = proc.proc.pid
    pids = [parent]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                # field 4 of stat is the parent; the name in field 2 may hold spaces, so split after its ")"
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    pids.append(int(entry.name))
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += len(os.listdir(f"/proc/{pid}/fd"))
    return total


def connect_many(port: int, n: int) -> list[socket.socket]:
    """`n` connected TCP sockets to 127.0.0.1:`port`, connected without blocking (a full accept queue delays
    a blocking connect by a SYN retry); each closes with a reset, so no TIME_WAIT is left to eat the ports."""
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.setblocking(False)
            rc = s.connect_ex(("127.0.0.1", port))
            if rc == errno.EINPROGRESS:
                sel.register(s, selectors.EVENT_WRITE)
            elif rc != 0:
                raise OSError(rc, os.strerror(rc))
        deadline = time.monotonic() + 30 * deadline_scale()
        while sel.get_map() and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=1):
                sel.unregister(key.fileobj)
                if rc := cast(socket.socket, key.fileobj).getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    raise OSError(rc, os.strerror(rc))
        assert not sel.get_map(), f"{len(sel.get_map())} of {n} connections not accepted (the server holds no more)"
        return socks
    except BaseException:
        close_all(socks)
        raise
    finally:
        sel.close()


def close_all(socks: list[socket.socket]) -> None:
    """Close every socket of `socks`."""
    for s in socks:
        s.close()


def raw_request(port: int, data: bytes, timeout_s: float = 10) -> bytes:
    """Send `data` on a fresh connection and read until the server closes; a reset mid-send reads as closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(data)
        out = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
        return out


def status_of(answer: bytes) -> int | None:
    """The status code of a raw HTTP/1.1 answer, or None when the server answered none (it closed)."""
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None
