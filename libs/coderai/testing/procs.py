"""Real service processes for integration tests: started with `python -m`, logs to a file, readiness read
from the log or polled with a deadline, never slept for."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any
from pathlib import Path

from coderai.runtime.supervisor import signal_group


def deadline_scale() -> float:
    """How much longer than on a quiet machine the suite waits for anything: `CODERAI_TEST_DEADLINE_SCALE`,
    default 3. The one constant for load: every deadline of `wait_until` and `wait_log` is multiplied by it.
    A deadline only bounds a wait that fails, so a larger scale makes a failing test slower, never a passing one;
    3 covers a run with two busy processes beside the suite on 2 cores (see docs/testing.md)."""
    return float(os.environ.get("CODERAI_TEST_DEADLINE_SCALE") or 3.0)


class ProcessDied(RuntimeError):
    """A process a test waits on is gone; waiting longer cannot help."""


class ServiceProcess:
    """One `python -m <module>` child in its own process group (so granian's workers stop with it)."""

    def __init__(
        self,
        name: str,
        module: str,
        args: list[str],
        env: dict[str, str],
        log_dir: Path,
        prefix: list[str] | None = None,
        python: str = "",
    ) -> None:
        self.name = name
        self.python = python or sys.executable  # another checkout's venv runs that checkout's code (bench baselines)
        self.module = module
        self.args = args
        self.env = env
        self.prefix = prefix or []  # e.g. `ip netns exec <host>`: it execs the command, so the pid stays ours
        self.log_path = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.log_offset = 0

    def start(self) -> "ServiceProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_offset = len(self.log_text())  # a restarted service appends: wait only on what it writes
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [*self.prefix, self.python, "-m", self.module, *self.args],
                env=self.env,
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_log(self, needle: str, timeout_s: float = 30.0, after: int | None = None) -> None:
        """Poll the log until `needle` appears past offset `after` (default: where this run's output starts);
        fail early if the process died."""
        after = self.log_offset if after is None else after
        timeout_s *= deadline_scale()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if needle in self.log_text()[after:]:
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise ProcessDied(f"{self.name} exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.name}: no {needle!r} in its log within {timeout_s}s:\n{self.log_text()[-3000:]}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole group, as a crash or a pulled plug would."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM and wait for a graceful exit; SIGKILL the group after the deadline."""
        self.terminate()
        return self.reap(timeout_s)

    def terminate(self) -> None:
        """SIGTERM: the process starts its graceful exit (`reap` waits for it)."""
        if self.proc is not None:
            self._signal(signal.SIGTERM)

    def reap(self, timeout_s: float = 15.0) -> int | None:
        """Wait for the exit `terminate` asked for; SIGKILL the group after the deadline (its children too)."""
        if self.proc is None:
            return None
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self._signal(signal.SIGKILL)
        self.proc.wait()
        return self.proc.returncode

    def _signal(self, sig: int) -> None:
        signal_group(self.proc, sig)


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    """Poll `predicate()` until it returns something truthy (returned); TimeoutError naming `what` otherwise.
    The deadline is `timeout_s` times `deadline_scale()`."""
    timeout_s *= deadline_scale()
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except ProcessDied:
            raise
        except Exception as exc:  # remembered for the timeout message
            last_exc = exc
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what} (last error: {last_exc!r})")


def run_interruptible(
    argv: list[str], timeout_s: float, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)` for a bench or a soak, except how it
    ends one that overruns: when the timeout passes, or the test is stopped meanwhile (pytest's own timeout), the
    child gets SIGINT and a minute for its `finally` (stop the servers it started, remove its namespaces and mounts)
    before SIGKILL. `subprocess.run` kills at once, which leaves a bench's servers running."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def processes_naming(text: str) -> list[str]:
    """The command lines of live processes that mention `text` (a bench's temporary dir: what it left running)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(cmdline)
    return found


FINE_TUNE_ENDED = ("succeeded", "failed", "cancelled")


def fine_tune_ended(client: Any, job_id: str, timeout_s: float, what: str = "the fine-tuning job to end") -> Any:
    """The OpenAI SDK's fine-tuning job `job_id` once it has ended (succeeded, failed or cancelled), polled twice
    a second; TimeoutError naming `what` otherwise."""
    return wait_until(
        lambda: (j := client.fine_tuning.jobs.retrieve(job_id)).status in FINE_TUNE_ENDED and j,
        timeout_s,
        what,
        interval_s=0.5,
    )
