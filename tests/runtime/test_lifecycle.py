"""A service told to stop while it is still starting stops then, not when it is killed: a worker looking for its
head by mDNS (or a bus not reachable yet) took SIGTERM as a note for later and went on looking until the 15 s
SIGKILL of whoever stopped it (Ctrl-C did nothing either)."""

from __future__ import annotations

import asyncio
import time

from coderai.runtime.lifecycle import serve_until_stopped
from coderai.testing.procs import ServiceProcess
from coderai.testing.stack import clean_env


async def test_a_stop_while_starting_cancels_the_start_and_closes_what_it_opened():
    stop = asyncio.Event()
    opened, cancelled = [], []
    started = asyncio.Event()

    async def start(stack, _stop):
        stack.callback(opened.append, "closed")
        started.set()
        try:
            await asyncio.Event().wait()  # looking for a head that never shows up
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    serving = asyncio.create_task(serve_until_stopped(start, stop=stop))
    await asyncio.wait_for(started.wait(), 5)  # the start is under way
    stop.set()
    await asyncio.wait_for(serving, 5)
    assert cancelled == [True] and opened == ["closed"]


async def test_a_start_that_fails_still_raises():
    async def start(_stack, _stop):
        raise RuntimeError("no such model folder")

    try:
        await asyncio.wait_for(serve_until_stopped(start), 5)
    except RuntimeError as exc:
        assert "no such model folder" in str(exc)
    else:
        raise AssertionError("the start's failure was swallowed")


def test_a_worker_still_looking_for_its_head_exits_on_sigterm(tmp_path):
    args = ["--cluster-token", "a-token-no-head-has", "--mdns-interface", "127.0.0.1", "--data-dir", str(tmp_path)]
    env = clean_env(CODERAI_WORKER_DISCOVER_TIMEOUT_S="1")
    worker = ServiceProcess("worker", "coderai.engine_worker", args, env, tmp_path / "logs").start()
    try:
        worker.wait_log("still looking", 60)
        t0 = time.monotonic()
        code = worker.stop(timeout_s=30)
        took = time.monotonic() - t0
    finally:
        worker.stop()
    assert took < 10, f"SIGTERM took {took:.1f} s (it waited for the SIGKILL)"
    assert code == 0 and "stopped before it was ready" in worker.log_text()
