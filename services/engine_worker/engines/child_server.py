"""A server run as a child process on loopback, owned by one engine: started from its argv and environment on a
free port, healthy once its ready path answers 200, its output kept in a log file whose tail says why it failed,
restarted with backoff when it dies, and stopped with every process it started.

Nothing here speaks the server's protocol beyond the health probe (openai_client does). The child gets
`death_signal` when the thread that started it dies (PR_SET_PDEATHSIG follows the forking thread, not the
process): the first start runs on the caller's thread (the engine's own, which lives as long as the engine), every
restart on the supervisor thread (`supervise`), which lives until `close`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

import httpx

from coderai.engine_worker.engines.base import EngineLoadError
from coderai.runtime.embedded import die_with_parent, free_port

EXITED = "it exited"
"""`ChildServer.state` of a child that is gone: a request it was answering may be answered by another engine."""

log = logging.getLogger("coderai.engine_worker")

Command = Callable[[int], tuple[list[str], dict[str, str]]]
"""command(port) -> (argv, environment) that start the server on 127.0.0.1:port"""

LOG_TAIL_CHARS = 4000  # of a start that failed
EXIT_TAIL_CHARS = 1500  # of a server that died while serving
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
CRASH_LIMIT = 5  # deaths within CRASH_WINDOW_S that park a server (quarantine) instead of restarting it again
CRASH_WINDOW_S = 600.0
POLL_S = 0.5  # how often the supervisor looks at the child


class ChildServer:
    """One server child: `start`, `supervise` (restart when it dies), `stop`, `close`; its log's head and tail.

    `label` names the server in messages, `name` (the model) prefixes log lines, `serving` is what a failed start
    was loading. `headers` go with every health probe (a server whose key guards its health route)."""

    def __init__(
        self,
        command: Command,
        *,
        label: str = "the server",
        name: str = "",
        serving: str = "",
        ready_path: str = "/health",
        death_signal: int = signal.SIGTERM,
        headers: dict[str, str] | None = None,
        start_timeout_s: float = 600.0,
        log_name: str = "server",
        port_for: Callable[[], int] = free_port,
        crash_limit: int = CRASH_LIMIT,
        crash_window_s: float = CRASH_WINDOW_S,
    ) -> None:
        self.command = command
        # a server that dies `crash_limit` times within `crash_window_s` is parked, not restarted again: a crash
        # loop costs a restart's load time every time and hides why; it runs again when its model is placed anew
        self.crash_limit, self.crash_window_s = crash_limit, crash_window_s
        self.crashes: list[float] = []  # when it died, within the window
        self.quarantined = ""  # why it is parked ("": it is not)
        self.label, self.name, self.serving = label, name, serving
        self.ready_path = ready_path
        self.death_signal = death_signal
        self.headers = dict(headers or {})
        self.start_timeout_s = start_timeout_s
        self.log_name = log_name
        self.port_for = port_for
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.base_url = ""
        self.log_path = ""
        self.restarts = 0
        self._closing = threading.Event()
        self._lock = threading.RLock()  # the child changes only under it (a restart against close)
        self._supervisor: threading.Thread | None = None

    def start(self, port: int | None = None) -> None:
        """Start the server (on `port`, else a free one) and wait until it is healthy; EngineLoadError with its log
        tail if it exits, is not healthy within `start_timeout_s`, or is closed meanwhile."""
        with self._lock:
            if self._closing.is_set():
                raise EngineLoadError(f"{self.label} was closed")
            port = port or self.port_for()
            cmd, env = self.command(port)
            fd, self.log_path = tempfile.mkstemp(prefix=f"coderai-{self.log_name}-{port}-", suffix=".log")
            with os.fdopen(fd, "wb") as out:
                try:
                    # a session of its own lets stop() reach the server's own children too
                    self.proc = subprocess.Popen(
                        cmd,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=env,
                        start_new_session=True,
                        preexec_fn=die_with_parent(self.death_signal),
                    )
                except OSError as exc:
                    self._drop_log()
                    raise EngineLoadError(f"cannot start {self.label} ({cmd[0]}): {exc}") from exc
            self.port = port
            self.base_url = f"http://127.0.0.1:{port}"
            self._wait_healthy()

    def _wait_healthy(self) -> None:
        proc = self.proc
        assert proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        with httpx.Client(timeout=2.0, headers=self.headers) as probe:
            while True:
                try:
                    if probe.get(f"{self.base_url}{self.ready_path}").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                left = deadline - time.monotonic()
                if self._closing.is_set():
                    why = "was stopped"
                elif left <= 0:
                    why = f"was not healthy after {self.start_timeout_s:.0f} s"
                else:
                    try:  # the poll interval doubles as exit detection
                        why = f"exited with code {proc.wait(timeout=min(0.5, left))}"
                    except subprocess.TimeoutExpired:
                        continue
                tail = self.log_tail()
                self.stop()
                loading = f" while loading {self.serving}" if self.serving else ""
                raise EngineLoadError(f"{self.label} {why}{loading}; its log ends:\n{tail}")

    def running(self) -> bool:
        proc = self.proc
        return proc is not None and proc.poll() is None

    def state(self, grace_s: float = 1.0) -> str:
        """Whether the child runs, for a message about a request that could not reach it. A killed process closes
        its sockets before it can be reaped, so a child whose connection just broke has `grace_s` to be seen gone."""
        proc = self.proc
        if proc is None:
            return EXITED
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return "it is running"
        return EXITED

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The end of the child's output (where a server says why it stopped)."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - chars))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def log_head(self, chars: int = 200_000) -> str:
        """The start of the child's output (where a server says which devices it found)."""
        try:
            with open(self.log_path, "rb") as fh:
                return fh.read(chars).decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop the server (SIGTERM, SIGKILL after `grace_s`) and every process of its session; its log goes."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the server's own children, should any outlive it
        self._drop_log()

    def _drop_log(self) -> None:
        if self.log_path:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)
            self.log_path = ""

    def close(self) -> None:
        """Stop the server for good: no restart follows, and the supervisor has ended (or 10 s went by)."""
        self._closing.set()
        with self._lock:
            self.stop()
        thread = self._supervisor
        if thread is not None and thread is not threading.current_thread():
            thread.join(10)

    def supervise(
        self,
        on_alive: Callable[[httpx.Client], None] | None = None,
        on_exit: Callable[[str], None] | None = None,
        on_restart: Callable[[], None] | None = None,
        poll_s: float = POLL_S,
        backoff_s: Sequence[float] = RESTART_BACKOFF_S,
    ) -> None:
        """Watch the child from a thread of its own: `on_alive(probe)` every `poll_s` while it runs (a client with
        the headers, for the server's own load probes); when it dies, `on_exit(why)`, then restarts with backoff
        until one is healthy, and `on_restart()` (with the new child in place, before anything else may change it)."""
        self._supervisor = threading.Thread(
            target=self._watch,
            args=(on_alive, on_exit, on_restart, poll_s, backoff_s),
            name=f"{self.log_name}-{self.name}",
            daemon=True,
        )
        self._supervisor.start()

    def _watch(
        self,
        on_alive: Callable[[httpx.Client], None] | None,
        on_exit: Callable[[str], None] | None,
        on_restart: Callable[[], None] | None,
        poll_s: float,
        backoff_s: Sequence[float],
    ) -> None:
        probe = httpx.Client(timeout=2.0, headers=self.headers)
        try:
            while not self._closing.wait(poll_s):
                proc = self.proc
                if proc is not None and proc.poll() is None:
                    if on_alive is not None:
                        on_alive(probe)
                    continue
                code = proc.returncode if proc is not None else None
                why = f"{self.label} exited with code {code}; its log ends:\n{self.log_tail(EXIT_TAIL_CHARS).strip()}"
                now = time.monotonic()
                self.crashes = [t for t in self.crashes if now - t <= self.crash_window_s] + [now]
                if len(self.crashes) >= self.crash_limit:
                    self.quarantined = (
                        f"quarantined: {self.label} died {len(self.crashes)} times within "
                        f"{self.crash_window_s:.0f} s and is not restarted again until its model is "
                        "placed anew (unplace and place it, or replace its config); " + why
                    )
                    why = self.quarantined
                log.error("%s: %s", self.name, why)
                if on_exit is not None:
                    on_exit(why)
                if self.quarantined:
                    return
                self._restart(on_restart, backoff_s)
        finally:
            probe.close()

    def _restart(self, on_restart: Callable[[], None] | None, backoff_s: Sequence[float]) -> None:
        for attempt in itertools.count():
            if self._closing.wait(backoff_s[min(attempt, len(backoff_s) - 1)]):
                return
            with self._lock:
                if self._closing.is_set():
                    return
                self.stop(grace_s=5)
                try:
                    self.start()
                except EngineLoadError as exc:
                    if not self._closing.is_set():
                        log.error("%s: restart %d of %s failed: %s", self.name, attempt + 1, self.label, exc)
                    continue
                self.restarts += 1
                log.info("%s: %s restarted (%d restarts so far)", self.name, self.label, self.restarts)
                if on_restart is not None:
                    on_restart()
            return
