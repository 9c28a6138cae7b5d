"""How the fake RunPod API (`fake_runpod`) runs a pod's process: `launch(env)` callables starting a Python module
or a real engine worker, dying with the fake, and `kill_process` to stop one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from coderai.runtime.embedded import die_with_parent

Launch = Callable[[dict[str, str]], subprocess.Popen]


def python_launcher(args: list[str], log_path: str | None = None) -> Launch:
    """A `launch` callable running `python <args>` with the pod's env over os.environ, in its own process group,
    dying with the fake (PDEATHSIG), output to `log_path` (or discarded)."""

    def launch(env: dict[str, str]) -> subprocess.Popen:
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        try:
            return subprocess.Popen(
                [sys.executable, *args],
                env={**os.environ, **env},
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        finally:
            if not isinstance(out, int):  # not DEVNULL: the child has its own copy
                out.close()

    return launch


def worker_pods(pod_dir: str | os.PathLike) -> Launch:
    """A `launch` that runs each pod as a real engine worker (`python -m coderai.engine_worker`) with the pod's
    env, its data dir and log under `pod_dir` (named after the pod)."""
    root = Path(pod_dir)
    root.mkdir(parents=True, exist_ok=True)

    def launch(env: dict[str, str]) -> subprocess.Popen:
        name = env.get("CODERAI_NODE_ID") or env["RUNPOD_POD_ID"]
        return python_launcher(["-m", "coderai.engine_worker"], str(root / f"{name}.log"))(
            {**env, "CODERAI_DATA_DIR": str(root / name)}
        )

    return launch


def kill_process(proc: subprocess.Popen | None, grace_s: float = 5.0) -> None:
    """SIGTERM a pod's process (its whole group when it leads one), SIGKILL after `grace_s`, and reap it."""
    if proc is None or proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
