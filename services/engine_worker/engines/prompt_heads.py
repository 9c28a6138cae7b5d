"""Snapshots of prompt heads on llama-server, so that a new session of an agent reuses the system prompt and tools
another session put in a slot that is busy now (issue 39).

llama-server reuses a prefix only from the slot it gives a request, or from its host RAM cache, which holds the
prompts of slots that were idle when a task came. An agent's first session keeps its slot busy turn after turn and
that slot's prompt never reaches the RAM cache, so a second session started meanwhile gets an idle slot and
prefills its ~20k tokens of system prompt and tools from zero. Here the first request of each long head (the tools
and the leading system messages) is saved once from its slot after it ends (`/slots/N?action=save`, the server's
`--slot-save-path`), and a later request of the same head that the slot book places in a slot without it gets the
snapshot restored there first (`action=restore`): a copy of the KV cells instead of a prefill.

Only the shared cache has snapshots: a model whose cache is per key (share_cache = false) or a book that turned
scoped never saves or restores. Snapshots are files in a private folder, bounded in bytes (least recently used
dropped first), deleted with the engine.

`chat_chain` and `text_chain` make a prompt's chain (slot_scope.Chain): for a chat, the head as one part and each
later message as one; for a raw prompt, fixed chunks of text.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import msgspec

from coderai.engine_worker.engines.slot_scope import Chain

log = logging.getLogger("coderai.engine_worker")

HEAD_ROLES = frozenset({"system", "developer"})
MIN_HEAD_CHARS = 4096  # a head shorter than this (about 1k tokens) prefills faster than a snapshot is worth
TEXT_CHUNK = 1024  # a raw prompt's parts
_enc = msgspec.json.Encoder(order="sorted")


def _digest(prev: int, part: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(prev.to_bytes(8, "little") + part, digest_size=8).digest(), "little")


def _chain(parts: Iterable[bytes]) -> Chain:
    """Each part's cumulative digest, with the bytes up to its end."""
    chain: list[tuple[int, int]] = []
    h, size = 0, 0
    for part in parts:
        h, size = _digest(h, part), size + len(part)
        chain.append((h, size))
    return tuple(chain)


def chat_chain(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> tuple[Chain, int]:
    """The chain of a chat and the size of its head (its first part: the tools and the system or developer
    messages it starts with; 0 when it has neither)."""
    n = 0
    while n < len(messages) and isinstance(messages[n], dict) and messages[n].get("role") in HEAD_ROLES:
        n += 1
    has_head = bool(tools or n)
    head = [_enc.encode([tools or [], messages[:n]])] if has_head else []
    chain = _chain(head + [_enc.encode(m) for m in messages[n:]])
    return chain, (chain[0][1] if has_head else 0)


def text_chain(prompt: str) -> Chain:
    """The chain of a raw prompt: its text in chunks of TEXT_CHUNK characters."""
    return _chain(prompt[i : i + TEXT_CHUNK].encode() for i in range(0, len(prompt), TEXT_CHUNK))


class HeadSnapshots:
    """The saved heads of one server: file name by head digest, least recently used first, at most `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._dir = ""
        self._files: OrderedDict[int, int] = OrderedDict()  # head digest -> bytes
        self._saving: set[int] = set()
        self._too_big: set[int] = set()  # heads whose snapshot outgrew the whole budget: never saved again
        self._lock = threading.Lock()
        self.saves = self.restores = 0

    @property
    def dir(self) -> str:
        """The folder, made when the server is started: 0700, since a snapshot is prompts in KV form."""
        if not self._dir:
            self._dir = tempfile.mkdtemp(prefix="coderai-heads-")
        return self._dir

    @staticmethod
    def name(head: int) -> str:
        return f"head-{head:016x}.bin"

    def has(self, head: int) -> bool:
        with self._lock:
            if head in self._files:
                self._files.move_to_end(head)
                return True
            return False

    def claim(self, head: int) -> bool:
        """Whether the caller should save `head` now (nobody has, nobody is)."""
        with self._lock:
            if head in self._files or head in self._saving or head in self._too_big:
                return False
            self._saving.add(head)
            return True

    def saved(self, head: int, ok: bool) -> None:
        """A save of `head` ended; a snapshot larger than the whole budget is not kept."""
        path = os.path.join(self.dir, self.name(head))
        size = os.path.getsize(path) if ok and os.path.exists(path) else 0
        with self._lock:
            self._saving.discard(head)
            if ok and 0 < size <= self.max_bytes:
                self._files[head] = size
                self.saves += 1
            else:
                if size > self.max_bytes and len(self._too_big) < 4096:
                    self._too_big.add(head)
                self._remove(head, path)
            while sum(self._files.values()) > self.max_bytes:
                old, _ = self._files.popitem(last=False)
                self._remove(old, os.path.join(self.dir, self.name(old)))

    def clear(self) -> None:
        """Forget every snapshot (the server restarted, or the cache turned per key)."""
        if not self._files:
            return
        with self._lock:
            for head in list(self._files):
                self._remove(head, os.path.join(self.dir, self.name(head)))

    def close(self) -> None:
        self.clear()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _remove(self, head: int, path: str) -> None:
        self._files.pop(head, None)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
