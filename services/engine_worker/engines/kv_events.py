"""What a vLLM server's prefix cache really holds, from the KV-cache events it publishes (`--kv-events-config`).

The router remembers a conversation's engine under affinity keys (digests the gateway makes) and sends the next
turn there, guessing that the engine still holds the conversation's prompt in its cache. vLLM says what it holds:
each `BlockStored` event names the blocks a request stored or reused (with the `session_id` the request carried),
each `BlockRemoved` the blocks it evicted, `AllBlocksCleared` a reset. The worker sends every job with its request
id as vLLM's `session_id` and the job's `cache_keys` (gateway/pipeline_admit.py), so `CacheBook` learns which
blocks hold which keys' prompts, and reports a key once the cache has lost more than half of its blocks: the
heartbeat carries it (`EngineStatus.evicted`), and the router forgets that key for that engine; the next turn goes
to the least busy holder instead of to a cold engine that may be busy.

The events carry the prompts' token ids, which are tenants' text: vLLM publishes them on an IPC socket in a
folder only the worker's user can enter (mode 0700), never on a TCP port another local user could subscribe to.
What the server sends is checked like any input: a malformed batch or event is skipped, and the book is bounded.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from coderai.contracts.nodes import EVICTED_MAX

log = logging.getLogger("coderai.engine_worker")

MAX_KEYS = 50_000
"""Affinity keys the book follows per server; past it the oldest is dropped silently (the router's own TTL and
bound still apply to it)."""
MAX_SESSIONS = 4_096
"""Requests whose keys are kept while their events may still come (vLLM publishes a request's blocks as they fill,
up to the end of its answer)."""
MAX_BLOCKS = 8_192
"""Blocks recorded per key: a prompt of 8,192 blocks is a million tokens or more."""
POLL_MS = 200  # how often the subscriber looks whether it should stop


class CacheBook:
    """Which affinity keys' prompts the server's cache holds, block by block; what it dropped since the last
    `drain`. Pure bookkeeping, safe across threads (the subscriber writes, jobs begin, the heartbeat drains)."""

    def __init__(self, max_keys: int = MAX_KEYS, max_sessions: int = MAX_SESSIONS) -> None:
        self.max_keys = max_keys
        self.max_sessions = max_sessions
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, tuple[str, tuple[str, ...]]] = OrderedDict()  # session -> (owner, keys)
        self._blocks: OrderedDict[tuple[str, str], tuple[set[Any], list[int]]] = OrderedDict()  # (owner, key) ->
        # (its blocks still held, [the most it held at once])
        self._holders: dict[Any, set[tuple[str, str]]] = {}  # block hash -> the keys whose prompt it holds
        self._evicted: dict[str, list[str]] = {}  # owner (an engine id) -> keys lost since the last drain

    def began(self, session: str, owner: str, keys: list[str]) -> None:
        """A request went to the server as `session`, its pick remembered under `keys` for engine `owner`: the
        blocks it stores or reuses hold those keys' prompts now (a key recorded before starts afresh)."""
        if not keys:
            return
        with self._lock:
            self._sessions[session] = (owner, tuple(keys))
            self._sessions.move_to_end(session)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
            for key in keys:
                self._drop((owner, key))
                self._blocks[(owner, key)] = (set(), [0])
            while len(self._blocks) > self.max_keys:
                self._drop(next(iter(self._blocks)))

    def stored(self, session: object, hashes: list[Any]) -> None:
        """Blocks a request stored or reused (a `BlockStored` event with its `session_id`)."""
        with self._lock:
            found = self._sessions.get(session) if isinstance(session, str) else None
            if found is None:
                return
            owner, keys = found
            for key in keys:
                held = self._blocks.get((owner, key))
                if held is None:
                    continue
                blocks, most = held
                for h in hashes:
                    if len(blocks) >= MAX_BLOCKS:
                        break
                    if h not in blocks:
                        blocks.add(h)
                        self._holders.setdefault(h, set()).add((owner, key))
                most[0] = max(most[0], len(blocks))  # a block evicted and stored again counts once

    def removed(self, hashes: list[Any]) -> None:
        """Blocks the server evicted: a key that lost more than half of its blocks is lost."""
        with self._lock:
            for h in hashes:
                for owned in self._holders.pop(h, ()):
                    held = self._blocks.get(owned)
                    if held is None:
                        continue
                    blocks, most = held
                    blocks.discard(h)
                    if len(blocks) * 2 < most[0]:
                        self._drop(owned)
                        self._evicted.setdefault(owned[0], []).append(owned[1])

    def cleared(self) -> None:
        """The whole cache is gone (a reset, or a new server after a crash): every key with blocks is lost."""
        with self._lock:
            for owned in [k for k, (blocks, _) in self._blocks.items() if blocks]:
                self._drop(owned)
                self._evicted.setdefault(owned[0], []).append(owned[1])

    def drain(self, owner: str) -> list[str]:
        """The keys `owner`'s cache lost since the last drain, at most EVICTED_MAX (the rest wait for the next)."""
        with self._lock:
            lost = self._evicted.get(owner)
            if not lost:
                return []
            out, rest = lost[:EVICTED_MAX], lost[EVICTED_MAX:]
            if rest:
                self._evicted[owner] = rest
            else:
                del self._evicted[owner]
            return list(dict.fromkeys(out))

    def holds(self, owner: str, key: str) -> int:
        """How many of the key's blocks the cache holds (0: none, or not followed)."""
        with self._lock:
            held = self._blocks.get((owner, key))
            return len(held[0]) if held is not None else 0

    def _drop(self, owned: tuple[str, str]) -> None:
        held = self._blocks.pop(owned, None)
        if held is None:
            return
        for h in held[0]:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(owned)
                if not holders:
                    del self._holders[h]


def _hashes(value: object) -> list[Any]:
    """Block hashes as vLLM sends them (ints or bytes); anything else is not a hash."""
    if not isinstance(value, list):
        return []
    return [h for h in value if isinstance(h, (int, bytes)) and not isinstance(h, bool)]


def apply_batch(book: CacheBook, payload: bytes) -> int:
    """One published batch (msgpack: [ts, [event, ...], rank?], each event a map tagged by `type`) into the book;
    returns how many events were applied. Malformed batches and events are skipped."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return 0
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        return 0
    applied = 0
    for event in batch[1]:
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "BlockStored":
            book.stored(event.get("session_id"), _hashes(event.get("block_hashes")))
        elif kind == "BlockRemoved":
            book.removed(_hashes(event.get("block_hashes")))
        elif kind == "AllBlocksCleared":
            book.cleared()
        else:
            continue
        applied += 1
    return applied


class KvEvents:
    """A server's KV events into a `CacheBook`: the IPC endpoint its server publishes on (in a private folder),
    and the thread that subscribes to it. `available()` says whether this interpreter can (pyzmq)."""

    def __init__(self, book: CacheBook | None = None) -> None:
        self.book = book or CacheBook()
        self.folder = Path(tempfile.mkdtemp(prefix="coderai-kv-"))  # 0700: only this user reaches the socket
        self.endpoint = f"ipc://{self.folder / 'events'}"
        self.batches = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def available() -> bool:
        try:
            import zmq  # noqa: F401
        except ImportError:
            return False
        return True

    def config(self) -> str:
        """The server's `--kv-events-config`: events on, published (bound) on this IPC endpoint."""
        return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint, "topic": ""})

    def start(self, on_batch: Callable[[], None] | None = None) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, args=(on_batch,), name="vllm-kv-events", daemon=True)
        self._thread.start()

    def _run(self, on_batch: Callable[[], None] | None) -> None:
        import zmq

        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVHWM, 100_000)
            sub.connect(self.endpoint)  # zmq retries until the server binds it, and after a restart
            while not self._stop.is_set():
                if not sub.poll(POLL_MS):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    continue
                apply_batch(self.book, frames[2])
                self.batches += 1
                if on_batch is not None:
                    on_batch()
        except Exception:  # the book stays as it was; routing goes on with the router's own guesses
            log.exception("vLLM's KV events: the subscriber stopped")
        finally:
            sub.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        shutil.rmtree(self.folder, ignore_errors=True)
