"""Hosts started on demand: a pool of OpenAI-compatible servers (machines that sleep, a server an operator's script
brings up) that the worker starts when a request needs one and stops once they have been idle. The lifecycle of
the `host` family (engines/host_engine.py relays the jobs), declared in the worker's `<data_dir>/host_pools.toml`
(engines/host_pools_file.py).

- A request takes the up host with the fewest requests in flight (the first declared, on a tie).
- With none up, exactly one host is started (its `start_cmd`, then its health probed until it answers), in the
  order declared, skipping those that failed within `down_s`; every request that comes meanwhile waits for that
  one start, at most its `start_timeout_s`, and then gets a retryable "no host" error (a 503), never a hang.
- A host that fails a request before its first token (it died: connection reset or refused) is taken out, and the
  request goes to another host, started if none is up; each host is tried once per request.
- A host idle (nothing in flight) for `idle_stop_s` gets its `stop_cmd` run; so does every host up when the last
  model using the pool is unloaded. Models of one worker that name the same pool share it.

Commands are argv lists run without a shell, in a session of their own, stdin closed, the worker's `CODERAI_*`
variables left out of their environment; one still running after `cmd_timeout_s` is killed with its process
group. The log says which program runs for which host and how it ended, never its arguments (they may carry a
token); the end of its output is logged when it fails.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO
from urllib.parse import urlsplit

from coderai.engine_worker.engines.host_pools_file import HostDecl, PoolDecl
from coderai.engine_worker.engines.loopback_http import LoopbackClient

log = logging.getLogger("coderai.engine_worker.host_pool")

OFF, STARTING, UP, STOPPING = "off", "starting", "up", "stopping"
PROBE_TIMEOUT_S = 5.0
OUTPUT_TAIL = 400  # bytes of a failed command's output in the log


class NoHost(RuntimeError):
    """No host of the pool could take the request: none up, and none could be started in time."""


class CommandFailed(RuntimeError):
    """A start or stop command exited non-zero, could not be run, or ran past its timeout (then it was killed)."""


def run_cmd(argv: tuple[str, ...], timeout_s: float, what: str) -> None:
    """Run `argv` (no shell) to its end, at most `timeout_s`; CommandFailed saying how it ended otherwise."""
    prog = argv[0] if os.path.isabs(argv[0]) else shutil.which(argv[0])
    if prog is None:
        raise CommandFailed(f"{what}: no program {argv[0]!r} on PATH")
    name = os.path.basename(argv[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODERAI_")}
    log.info("%s: running %s (%d args, at most %gs)", what, name, len(argv) - 1, timeout_s)
    began = time.monotonic()
    # output to a file, not a pipe: a server the command leaves running may keep a pipe open past the command
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen(
                [prog, *argv[1:]],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            raise CommandFailed(f"{what}: {name} could not be run ({exc.strerror})") from None
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.warning("%s: %s still running after %gs: killed", what, name, timeout_s)
            raise CommandFailed(f"{what}: {name} still running after {timeout_s:g}s, killed") from None
        took = time.monotonic() - began
        if rc != 0:
            log.warning("%s: %s exited %d after %.1fs; its output ends: %s", what, name, rc, took, _tail(out))
            raise CommandFailed(f"{what}: {name} exited {rc}")
    log.info("%s: %s done in %.1fs", what, name, took)


def _tail(out: IO[bytes]) -> str:
    size = out.seek(0, os.SEEK_END)
    out.seek(max(0, size - OUTPUT_TAIL))
    return out.read().decode("utf-8", "replace").strip() or "(nothing)"


def _probe_client(url: str) -> LoopbackClient:
    u = urlsplit(url)
    tls = u.scheme == "https"
    return LoopbackClient(
        u.hostname or "",
        u.port or (443 if tls else 80),
        PROBE_TIMEOUT_S,
        tls=tls,
        read_timeout_s=PROBE_TIMEOUT_S,
        max_body=1 << 16,
    )


@dataclass(eq=False)
class Host:
    """One host's state (changed under its pool's condition) and its commands' lock (a start and a stop of one host
    never run at once)."""

    index: int
    decl: HostDecl
    probe: LoopbackClient
    state: str = OFF
    in_flight: int = 0
    last_used: float = 0.0
    down_until: float = 0.0
    last_error: str = ""
    launched: bool = False  # its start_cmd ran and no stop_cmd since
    starts: int = 0
    stops: int = 0
    cmd_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return self.decl.url


@dataclass
class Attempt:
    """What one request did so far: hosts that failed it, and hosts whose start it asked for (each once)."""

    failed: set[Host] = field(default_factory=set)
    triggered: set[Host] = field(default_factory=set)


class HostPool:
    """The hosts of one declared pool and their lifecycle; thread-safe."""

    def __init__(self, name: str, decl: PoolDecl) -> None:
        self.name, self.decl = name, decl
        self.hosts = [Host(i, d, _probe_client(d.url)) for i, d in enumerate(decl.hosts)]
        self.wait_s = max(d.start_timeout_s for d in decl.hosts) + 1.0
        self.cond = threading.Condition()
        self.closed = threading.Event()
        self.users = 0
        self.waiting = 0  # requests waiting for a host
        self._starter: threading.Thread | None = None
        self._idler = threading.Thread(target=self._idle_loop, name=f"host-pool-{name}-idle", daemon=True)
        self._idler.start()

    def what(self, h: Host) -> str:
        return f"host pool {self.name}: {h.url}"

    # --- requests ---------------------------------------------------------------------------------------------------

    def acquire(self, attempt: Attempt, cancelled: Callable[[], bool] = lambda: False) -> Host:
        """The up host with the fewest requests in flight (counted in until `release`), starting one if none is
        up; NoHost when none comes up in time, or once `cancelled()` (after a `wake`)."""
        deadline = time.monotonic() + self.wait_s
        with self.cond:
            try:
                return self._acquire(attempt, cancelled, deadline)
            finally:
                self.cond.notify_all()  # one waiter less: the idle timer may run again

    def _acquire(self, attempt: Attempt, cancelled: Callable[[], bool], deadline: float) -> Host:
        """`acquire`, under the condition."""
        while True:
            if self.closed.is_set():
                raise NoHost(f"host pool {self.name} is closed (its model was unloaded)")
            if cancelled():
                raise NoHost("cancelled while waiting for a host")
            up = [h for h in self.hosts if h.state == UP and h not in attempt.failed]
            if up:
                h = min(up, key=lambda h: h.in_flight)
                h.in_flight += 1
                return h
            if self._starter is None:
                cand = self._candidate(attempt)
                if cand is None:
                    raise NoHost(self._none_left())
                attempt.triggered.add(cand)
                self._start(cand)
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoHost(f"no host of pool {self.name} came up within {self.wait_s - 1:g}s")
            self.waiting += 1  # while a request waits, no host is stopped for being idle
            try:
                self.cond.wait(left)
            finally:
                self.waiting -= 1

    def wake(self) -> None:
        """Have the requests waiting for a host look again (one was cancelled)."""
        with self.cond:
            self.cond.notify_all()

    def release(self, h: Host) -> None:
        with self.cond:
            h.in_flight -= 1
            h.last_used = time.monotonic()
            self.cond.notify_all()  # its idle timer starts now

    def failed(self, h: Host, exc: BaseException) -> None:
        """`h` failed a request before its first token: taken out until a start (or a probe) finds it up again."""
        with self.cond:
            h.last_error = f"{type(exc).__name__}: {exc}"[:300]
            if h.state == UP:
                log.warning("%s failed a request, taken out: %s", self.what(h), h.last_error)
                h.state = OFF
                h.down_until = time.monotonic() + self.decl.down_s
            self.cond.notify_all()

    def _candidate(self, attempt: Attempt) -> Host | None:
        """The host to start: the first declared that did not fail lately, else the one back soonest."""
        now = time.monotonic()
        left = [
            h
            for h in self.hosts
            if h.state in (OFF, STOPPING) and h not in attempt.failed and h not in attempt.triggered
        ]
        fresh = [h for h in left if h.down_until <= now]
        return fresh[0] if fresh else min(left, key=lambda h: h.down_until, default=None)

    def _none_left(self) -> str:
        why = "; ".join(f"{h.url}: {h.last_error}" for h in self.hosts if h.last_error)
        return f"no host of pool {self.name} could take the request" + (f" ({why})" if why else "")

    # --- starting -------------------------------------------------------------------------------------------------

    def survey(self) -> None:
        """Probe each host not known up, once: one already running (left by a previous run, or started by hand)
        is taken as up, and stopped when idle like the others. Called at load, outside any request."""
        for h in self.hosts:
            with self.cond:
                if h.state != OFF or self._starter is not None:
                    continue
            if self._healthy(h):
                with self.cond:
                    if h.state == OFF:
                        log.info("%s is up already", self.what(h))
                        h.state, h.last_used, h.down_until = UP, time.monotonic(), 0.0
                        self.cond.notify_all()

    def _start(self, h: Host) -> None:
        """Start `h` in a thread of its own (called under the condition): the requests wait for it, each as long as
        it will, and the start goes on to its own timeout whoever is still waiting."""
        h.state = STARTING
        self._starter = threading.Thread(target=self._run_start, args=(h,), name=f"host-pool-{self.name}-start")
        self._starter.daemon = True
        self._starter.start()

    def _run_start(self, h: Host) -> None:
        ok = False
        try:
            with h.cmd_lock:  # after a stop of the same host still running
                ok = self._bring_up(h)
        except Exception as exc:  # a thread's outermost edge: the host is not up, saying why
            h.last_error = f"{type(exc).__name__}: {exc}"[:300]
            log.exception("%s: start failed", self.what(h))
        finally:
            with self.cond:
                self._starter = None
                now = time.monotonic()
                if ok and not self.closed.is_set():
                    h.state, h.last_used, h.down_until, h.last_error = UP, now, 0.0, ""
                    log.info("%s is up", self.what(h))
                else:
                    h.state, h.down_until = OFF, now + self.decl.down_s
                    log.warning("%s did not come up: %s", self.what(h), h.last_error)
                self.cond.notify_all()

    def _bring_up(self, h: Host) -> bool:
        d = h.decl
        deadline = time.monotonic() + d.start_timeout_s
        if self._healthy(h):
            return True
        if d.start_cmd is None:
            h.last_error = "not up, and it has no start_cmd"
            return False
        try:
            run_cmd(d.start_cmd, min(d.cmd_timeout_s, d.start_timeout_s), f"{self.what(h)} start")
        except CommandFailed as exc:
            h.last_error = str(exc)
            return False
        h.starts += 1
        h.launched = True
        pause = 0.05
        while not self.closed.is_set():
            if self._healthy(h):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                h.last_error = f"no healthy answer at {d.health_path} within {d.start_timeout_s:g}s of its start_cmd"
                return False
            self.closed.wait(min(pause, left))
            pause = min(pause * 2, 1.0)
        h.last_error = "the pool was closed while it started"
        return False

    def _healthy(self, h: Host) -> bool:
        """Whether `h` answers its health path under 500 (llama-server answers 503 while it loads the model; an
        answer of 401 is a server that is up and wants a key)."""
        prefix = urlsplit(h.url).path.rstrip("/")
        try:
            return h.probe.get(prefix + h.decl.health_path).status < 500
        except Exception:  # not up, whatever the reason (refused, reset, timed out, not HTTP)
            return False

    # --- stopping ---------------------------------------------------------------------------------------------------

    def _idle_loop(self) -> None:
        while True:
            with self.cond:
                if self.closed.is_set():
                    return
                due, wait = self._due()
                if due is None:
                    self.cond.wait(wait)
                    continue
                due.state = STOPPING
            self._stop(due, f"idle for {due.decl.idle_stop_s:g}s")

    def _due(self) -> tuple[Host | None, float | None]:
        """The host to stop now for being idle, or how long until the next one may be (None: no timer)."""
        if self.waiting:  # a request is about to take a host that is up: none is idle (notified when it has)
            return None, None
        now = time.monotonic()
        soonest: float | None = None
        for h in self.hosts:
            d = h.decl
            if h.state != UP or h.in_flight or d.stop_cmd is None or d.idle_stop_s <= 0:
                continue
            at = h.last_used + d.idle_stop_s
            if at <= now:
                return h, None
            soonest = at if soonest is None else min(soonest, at)
        return None, None if soonest is None else soonest - now

    def _stop(self, h: Host, why: str) -> None:
        stop_cmd = h.decl.stop_cmd
        try:
            with h.cmd_lock:
                if stop_cmd is not None:
                    log.info("%s: stopping (%s)", self.what(h), why)
                    run_cmd(stop_cmd, h.decl.cmd_timeout_s, f"{self.what(h)} stop")
                    h.stops += 1
                    h.launched = False
        except CommandFailed as exc:  # logged by run_cmd; the host may still run: a later probe finds it up
            h.last_error = str(exc)
        finally:
            with self.cond:
                if h.state == STOPPING:
                    h.state = OFF
                self.cond.notify_all()

    def close(self) -> None:
        """Stop every host that is up or was started here (after a start still running ends), then the timers."""
        with self.cond:
            self.closed.set()
            starter = self._starter
            self.cond.notify_all()
        if starter is not None:
            starter.join(max(d.cmd_timeout_s for d in self.decl.hosts) + PROBE_TIMEOUT_S + 1)
        with self.cond:
            stopping = [h for h in self.hosts if (h.state == UP or h.launched) and h.decl.stop_cmd is not None]
            for h in stopping:
                h.state = STOPPING
        for h in stopping:
            self._stop(h, "its model was unloaded")
        self._idler.join(5)
        for h in self.hosts:
            h.probe.close()


_POOLS: dict[tuple[str, PoolDecl], HostPool] = {}
_POOLS_LOCK = threading.Lock()


def open_pool(name: str, decl: PoolDecl) -> HostPool:
    """The worker's pool `name` as declared (shared by the models that name it), counted as used once more."""
    with _POOLS_LOCK:
        pool = _POOLS.get((name, decl))
        if pool is None:
            pool = _POOLS[(name, decl)] = HostPool(name, decl)
        pool.users += 1
        return pool


def release_pool(pool: HostPool) -> None:
    """One model less uses `pool`: after the last, its hosts are stopped."""
    with _POOLS_LOCK:
        pool.users -= 1
        if pool.users > 0:
            return
        _POOLS.pop((pool.name, pool.decl), None)
    pool.close()
