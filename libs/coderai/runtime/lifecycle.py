"""Service lifecycle: an exit stack of resources, SIGTERM/SIGINT to drain, a second signal to leave at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable

log = logging.getLogger("coderai.lifecycle")

Starter = Callable[[contextlib.AsyncExitStack, asyncio.Event], Awaitable[None]]


async def stop_task(task: asyncio.Task) -> None:
    """Cancel `task` and wait until it has ended (its `finally` run), for an exit stack's async callback: a task
    only told to stop may still hold a subscription when the connection drains, which then waits for it."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


async def serve_until_stopped(
    start: Starter, *, drain_timeout_s: float = 10.0, stop: asyncio.Event | None = None
) -> None:
    """Run `start(stack, stop)`, which opens resources onto `stack`, then wait for a signal (or `stop`).

    Resources close in reverse order of opening, so a service that subscribes last stops intake first,
    then finishes in-flight work (bounded by `drain_timeout_s`), then drains its NATS connection.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = 0

    def _on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            log.warning("second signal: exiting now")
            os._exit(130)
        log.info("signal %s: draining", signal.Signals(signum).name)
        stop.set()

    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, _on_signal, s)
    stack = contextlib.AsyncExitStack()
    try:
        # a signal while starting (a worker still looking for its head, a bus not reachable yet) stops the start
        # at once: it would otherwise go on until the process is killed
        starting = asyncio.ensure_future(start(stack, stop))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not starting.done():
            await stop_task(starting)
            log.info("stopped before it was ready")
            return
        starting.result()
        log.info("ready")
        await stop.wait()
    finally:
        try:
            await asyncio.wait_for(stack.aclose(), drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("drain took longer than %.0fs; leaving", drain_timeout_s)
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(s)


async def wait_for(
    predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float, interval_s: float = 0.05, what: str = "condition"
) -> None:
    """Poll `predicate` until true, or raise TimeoutError after `timeout_s` naming `what`."""
    deadline = loop_time() + timeout_s
    while True:
        ok = predicate()
        if asyncio.iscoroutine(ok):
            ok = await ok
        if ok:
            return
        if loop_time() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)


def loop_time() -> float:
    return asyncio.get_running_loop().time()
