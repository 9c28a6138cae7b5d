"""Random ids for every request, drawn from one `os.urandom` block at a time.

`secrets.token_hex` makes a `getrandom` syscall per call, and the gateway draws several ids per request (its
request id, a reply subject's token, the outbox's). These draw from a 4 KiB block of the same kernel randomness,
each byte handed out once, so an id is exactly as unguessable as `secrets.token_hex`'s; a forked child starts
with a fresh block (never its parent's next ids).
"""

from __future__ import annotations

import os
import threading

BLOCK = 4096


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf = b""
        self._pos = 0

    def take(self, n: int) -> bytes:
        with self._lock:
            if self._pos + n > len(self._buf):
                self._buf = os.urandom(max(BLOCK, n))
                self._pos = 0
            out = self._buf[self._pos : self._pos + n]
            self._pos += n
            return out

    def forget(self) -> None:
        """Drop what is left (after a fork: the child must not hand out the ids its parent will)."""
        self._lock = threading.Lock()
        self._buf = b""
        self._pos = 0


_pool = _Pool()
os.register_at_fork(after_in_child=_pool.forget)


def token_bytes(n: int) -> bytes:
    """`n` random bytes, as `secrets.token_bytes(n)`."""
    return _pool.take(n)


def token_hex(n: int) -> str:
    """`n` random bytes as `2n` hex digits, as `secrets.token_hex(n)`."""
    return _pool.take(n).hex()
