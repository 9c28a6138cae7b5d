"""A model replaced on purpose (reloaded with other params): the jobs that come while its old engine drains and its
new one loads wait for the new one, queued, instead of finding nobody listening.

The old host keeps its op subscriptions open (in the `INTAKE_QUEUE` queue group, which the new host joins too, so
no job is answered twice) and hands each new job here; the job waits, sending queued keep-alives (the gateway
waits for those up to its queue timeout), until the new host's load has ended, then runs on it, or is answered a
retryable `no_engine` when that load failed or was dropped (the gateway then tries elsewhere). Jobs already on the
old engine finish there first (`EngineHost.unload`'s grace). A crash is not a replace: a server that died is
restarted by its supervisor and its engine takes nothing meanwhile (`EngineHost._lost`).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from coderai.contracts import BusError, ErrorReply
from coderai.runtime.bus import FrameWriter

if TYPE_CHECKING:
    from coderai.engine_worker.host import EngineHost

INTAKE_QUEUE = "engine"  # the queue group of an engine's op subscriptions: an old and a new host share its subject
HANDOVER_QUEUE = 256  # jobs that may wait for a new engine at once, unless the old one had a queue limit of its own


def admit(successor: EngineHost, limit: int, coro: Any) -> None:
    """Start a job handed over to `successor` as one of its tasks (its unload waits for them, bounded), or refuse
    it as `busy` beyond `limit` waiting and running there."""
    limit = limit or HANDOVER_QUEUE
    if len(successor._tasks) >= limit:
        raise BusError(
            "busy",
            f"{successor.config.name} is being reloaded and {limit} requests already wait for it",
            retryable=True,
            retry_after_s=max(1.0, successor.service_s),
        )
    successor.spawn(coro)


async def run_after_load(
    old: EngineHost, successor: EngineHost, op: str, job: Any, writer: FrameWriter, headers: dict[str, str]
) -> None:
    """Wait for `successor`'s load to end (queued keep-alives meanwhile), then run the job there. A cancel heard
    meanwhile came to `old` (the successor listens only once loaded): it goes along, so the job never runs."""
    while not successor.settled.is_set():
        await writer.keepalive(queued=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(successor.settled.wait(), successor.keepalive_s)
    if successor.state != "ready" or successor.engine is None:
        why = f": {successor.error}" if successor.error else ""
        await writer.answer(
            ErrorReply(
                code="no_engine",
                message=f"{successor.config.name} was reloaded and its new engine is not serving ({successor.state}{why})",
                retryable=True,
                seq=writer.next_seq(),
            )
        )
        return
    if old._early_cancels.pop(job.request_id, "absent") is None:
        successor._early_cancels[job.request_id] = None
    await successor._run(op, job, writer, headers)
