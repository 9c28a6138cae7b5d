"""A helper process an engine keeps beside its server (a Ray head or member, an SGLang rank of a plan over nodes):
started in its own session with its output in a log file, dying with the worker, stopped with its whole group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile

from coderai.engine_worker.engines.base import EngineLoadError


def start_process(cmd: list[str], env: dict[str, str], what: str) -> tuple[subprocess.Popen, str]:
    """`cmd` started with `env` added to this environment; the process and its log's path."""
    from coderai.runtime.embedded import die_with_parent

    fd, log_path = tempfile.mkstemp(prefix=f"coderai-{what}-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        try:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env},
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        except OSError as exc:
            raise EngineLoadError(f"cannot start {what}: {exc}") from exc
    return proc, log_path


def stop_process(proc: subprocess.Popen | None) -> None:
    """SIGTERM to its group, SIGKILL after 15 s."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
