"""Supervised child processes for `coderai up`: each service in its own session, restarted with backoff when it
dies, and stopped as a whole group (granian's workers included) so that nothing outlives the supervisor."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from coderai.runtime.embedded import die_with_parent, open_log

log = logging.getLogger("coderai.up")


def signal_group(proc: subprocess.Popen | None, sig: int) -> None:
    """Signal the process group a child leads (it was started in a session of its own); gone is fine."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    next_start: float = 0.0
    backoff_s: float = field(default=0.5)

    def start(self) -> None:
        out = open_log(self.log_path)
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        if not isinstance(out, int):  # not DEVNULL: the child has its own copy
            out.close()
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        signal_group(self.proc, sig)


class Supervisor:
    def __init__(self) -> None:
        self.children: list[Child] = []

    def add(self, child: Child) -> Child:
        self.children.append(child)
        child.start()
        assert child.proc is not None  # start() just set it
        log.info("started %s (pid %d)", child.name, child.proc.pid)
        return child

    def tick(self) -> None:
        """Restart children that died, waiting longer after each quick death (reset after a minute up)."""
        now = time.monotonic()
        for c in self.children:
            if c.alive():
                if now - c.started > 60:
                    c.backoff_s = 0.5
                continue
            if c.next_start == 0.0:
                code = c.proc.returncode if c.proc else None
                log.warning("%s exited with %s; restarting in %.1fs (log: %s)", c.name, code, c.backoff_s, c.log_path)
                c.signal_group(signal.SIGKILL)  # leftovers of its group, if any
                c.next_start = now + c.backoff_s
                c.backoff_s = min(c.backoff_s * 2, 30.0)
            elif now >= c.next_start:
                c.next_start = 0.0
                c.restarts += 1
                c.start()

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every group, wait, then SIGKILL whatever is left; children stop in reverse start order."""
        for c in reversed(self.children):
            c.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in reversed(self.children):
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", c.name)
            c.signal_group(signal.SIGKILL)  # granian workers or anything else left in the group
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
