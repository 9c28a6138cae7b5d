"""`request.completed` events on their way to the EVENTS stream, which usage, spend and Prometheus are built from.

A core publish is lost when NATS is down or restarts with it in flight, so each event is published with a
JetStream ack and its request id as `Nats-Msg-Id`: an event not acked is kept here and sent again once NATS is
back, and one sent twice (its ack lost) is stored once, by the stream's duplicate window. The request itself never
waits on NATS: `put` only appends, and a task of its own publishes, up to `BATCH` events at once.

A gateway killed (SIGKILL, a crash) between an answer and its event's ack would lose the event, and the usage with
it (the soak saw one). So `put` also writes the event to a journal file of this process (`Journal`) before the
answer's last bytes go out, and the acks are written there as they come: a gateway that starts finds the journals
of gateways that died and sends what they had not had acked. Plain writes, no fsync: they outlive the process (the
kernel has them), not the machine.

Each journal line carries an HMAC of itself under a key in `secrets/` (`outbox-journal.key`, 0600), so a line put
into the folder by anyone else (a forged `cost_usd: -50` would have lowered a key's spend at the next start) is not
replayed: it is skipped and counted in a warning."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
from pathlib import Path

from nats.js.errors import NoStreamResponseError

from coderai.contracts import RequestCompleted, decode, encode
from coderai.contracts.subjects import EVT_REQUEST_COMPLETED
from coderai.runtime.bus import Bus
from coderai.runtime.members import ensure_secret

log = logging.getLogger("coderai.gateway")

BATCH = 64
ACK_TIMEOUT_S = 2.0
RETRY_S = (0.25, 2.0)  # the wait after a failed round (NATS down, restarting, or its disk full), doubling up to


JOURNAL_KEY = "outbox-journal.key"  # in the data dir's secrets/: what the journal's lines are signed with
JOURNAL_ROTATE_BYTES = 16 << 20  # a journal past this is started afresh with only what still waits


MAC_HEX = 64  # an HMAC-SHA256 in hex, then a space, before each line's kind and body


class Journal:
    """One gateway process's events, written as they are put and marked as they are acked (`outbox-*.jsonl` in
    `folder`, locked while the process lives). `orphans()` takes over the journals of processes that died. Every
    line is `<hmac> <kind><body>` under `key`; a line whose MAC does not verify is never read back."""

    def __init__(self, folder: Path, key: bytes) -> None:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.folder = folder
        self.key = key
        self.path, self.fd = self._open()

    def _line(self, body: bytes) -> bytes:
        return hmac.new(self.key, body, hashlib.sha256).hexdigest().encode() + b" " + body + b"\n"

    def _verified(self, line: bytes) -> bytes | None:
        """The line's kind and body when its MAC is this journal key's, else None."""
        mac, _, body = line.partition(b" ")
        good = hmac.new(self.key, body, hashlib.sha256).hexdigest().encode()
        return body if len(mac) == MAC_HEX and hmac.compare_digest(mac, good) else None

    def _open(self) -> tuple[Path, int]:
        path = self.folder / f"outbox-{os.getpid()}-{secrets.token_hex(4)}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held while this process lives: a journal nobody holds is an orphan
        return path, fd

    def event(self, done: RequestCompleted) -> None:
        os.write(self.fd, self._line(b"E" + encode(done)))

    def acked(self, ids: list[str]) -> None:
        if ids:
            os.write(self.fd, self._line(b"A" + json.dumps(ids).encode()))

    def empty(self) -> None:
        """Everything written was acked: start the file over."""
        os.ftruncate(self.fd, 0)

    def rotate(self, waiting: collections.deque[RequestCompleted]) -> None:
        """A new file holding only `waiting` (nothing is being sent), the old one removed."""
        old_path, old_fd = self.path, self.fd
        self.path, self.fd = self._open()
        for done in waiting:
            self.event(done)
        old_path.unlink(missing_ok=True)
        os.close(old_fd)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self, keep: bool) -> None:
        """`keep`: events still wait (NATS away at shutdown), left for the next gateway to send."""
        if not keep:
            self.path.unlink(missing_ok=True)
        os.close(self.fd)

    def orphans(self) -> list[RequestCompleted]:
        """The events not acked in journals no live process holds, copied into this one (so a crash now loses
        nothing either), their files removed."""
        found: list[RequestCompleted] = []
        for path in sorted(self.folder.glob("outbox-*.jsonl")):
            if path == self.path:
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # another gateway process took it a moment ago
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # its process lives
                    continue
                if not path.exists():  # taken and removed between our open and our lock
                    continue
                events, acked = self._read(path)
                for done in events:
                    if done.request_id not in acked:
                        self.event(done)
                        found.append(done)
                path.unlink(missing_ok=True)
            finally:
                os.close(fd)
        return found

    def _read(self, path: Path) -> tuple[list[RequestCompleted], set[str]]:
        events, acked, forged = [], set(), 0
        for line in path.read_bytes().splitlines():
            body = self._verified(line)
            if body is None:  # not written by a gateway with this head's key (or cut short by the kill)
                forged += 1
                continue
            try:
                if body[:1] == b"E":
                    events.append(decode(body[1:], RequestCompleted))
                elif body[:1] == b"A":
                    acked.update(json.loads(body[1:]))
            except Exception:  # signed but unreadable: an older version's shape
                log.warning("journal %s: a line that does not read, skipped", path.name)
        if forged:
            log.warning(
                "journal %s: %d lines whose MAC does not verify (written by someone else, or cut short), not replayed",
                path.name,
                forged,
            )
        return events, acked


class Outbox:
    """At most `limit` events waiting (the oldest dropped beyond it, with one warning per thousand). With
    `journal_dir`, each event is journalled (see the module's text)."""

    def __init__(
        self, bus: Bus, limit: int = 100_000, journal_dir: Path | None = None, journal_key: Path | None = None
    ) -> None:
        self.bus = bus
        self.limit = limit
        self.journal_dir = journal_dir
        self.journal_key = journal_key or (journal_dir.parent / "secrets" / JOURNAL_KEY if journal_dir else None)
        self.journal: Journal | None = None
        self._sending: list[RequestCompleted] = []  # the batch being published
        self.queue: collections.deque[RequestCompleted] = collections.deque()
        self.dropped = 0
        self.no_stream = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # nothing waiting and nothing being sent
        self._idle.set()
        self._task: asyncio.Task | None = None

    def put(self, done: RequestCompleted) -> None:
        if len(self.queue) >= self.limit:
            self.queue.popleft()
            self.dropped += 1
            if self.dropped % 1000 == 1:
                log.warning(
                    "request.completed outbox full (%d waiting): %d events dropped so far", self.limit, self.dropped
                )
        if self.journal is not None:
            try:
                self.journal.event(done)
            except OSError as exc:  # a full disk: the event still goes out, only a crash would lose it now
                log.warning("request.completed journal not written: %s", exc)
        self.queue.append(done)
        self._idle.clear()
        self._wake.set()

    def start(self) -> None:
        if self.journal_dir is not None:
            try:
                assert self.journal_key is not None
                self.journal = Journal(self.journal_dir, ensure_secret(self.journal_key).encode())
                left = self.journal.orphans()
            except OSError as exc:
                log.warning("no request.completed journal in %s: %s", self.journal_dir, exc)
                self.journal, left = None, []
            if left:
                log.info("%d request.completed events left by a gateway that stopped: sending them", len(left))
                self.queue.extend(left)
                self._idle.clear()
        self._task = asyncio.create_task(self._run(), name="completed-outbox")

    async def close(self, deadline_s: float = 3.0) -> None:
        """Send what is waiting (for at most `deadline_s`), then stop."""
        if self._task is not None:  # without the sender (never started) nothing would drain the queue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), deadline_s)
        if self.queue:
            log.warning("%d request.completed events not sent at shutdown", len(self.queue))
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.journal is not None:  # events waiting, or cut off in flight: the next gateway sends them
            self.journal.close(keep=bool(self.queue or self._sending))

    async def _run(self) -> None:
        wait = RETRY_S[0]
        while True:
            if not self.queue:
                self._journal(lambda j: j.empty())  # every event written was acked
                self._wake.clear()
                self._idle.set()
                await self._wake.wait()
                continue
            if self.journal is not None and self.journal.size() > JOURNAL_ROTATE_BYTES:
                self._journal(lambda j: j.rotate(self.queue))  # busy without a pause: nothing is being sent now
            batch = self._sending = [self.queue.popleft() for _ in range(min(BATCH, len(self.queue)))]
            results = await asyncio.gather(*(self._send(e) for e in batch), return_exceptions=True)
            self._sending = []
            failed = [e for e, r in zip(batch, results) if isinstance(r, BaseException)]
            self._journal(
                lambda j: j.acked([e.request_id for e, r in zip(batch, results) if not isinstance(r, BaseException)])
            )
            if not failed:
                wait = RETRY_S[0]
                continue
            self.queue.extendleft(reversed(failed))  # first in, first out, as they came
            log.debug(
                "%d request.completed events not acked (%s); again in %.2fs",
                len(failed),
                next(r for r in results if isinstance(r, BaseException)),
                wait,
            )
            await asyncio.sleep(wait)
            wait = min(wait * 2, RETRY_S[1])

    def _journal(self, step) -> None:
        if self.journal is not None:
            try:
                step(self.journal)
            except OSError as exc:
                log.warning("request.completed journal: %s", exc)

    async def _send(self, done: RequestCompleted) -> None:
        try:
            await self.bus.js.publish(
                EVT_REQUEST_COMPLETED(),
                EVT_REQUEST_COMPLETED.encode(done),
                timeout=ACK_TIMEOUT_S,
                headers={"Nats-Msg-Id": done.request_id},
            )
        except NoStreamResponseError:
            # no EVENTS stream on this server (a bare nats-server, as some tests run): nothing stores events, and
            # the core subscribers (the router) already had this one, so sending it again would only repeat it
            if not self.no_stream:
                log.info("no EVENTS stream on this NATS: request.completed events are not stored")
            self.no_stream += 1
