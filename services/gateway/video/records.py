"""A video job's record, and how a job outlives the gateway that accepted it.

The record in `coderai_videos` carries the job itself (`job`), whose key asked for it (`key_name`) and which
gateway runs it (`runner`). The runner touches the record every few seconds; every gateway replica sweeps the
bucket, and a `queued`/`in_progress` record untouched for the takeover threshold is claimed by exactly one of
them (a revision-checked write: the first to write wins, the others see a newer revision and back off). The
winner goes on from the record: a relayed job from its last handoff, a whole-model job from the start. The
runner's own writes are revision-checked too (`VideoTenure`), so a gateway that was only slow (taken for dead)
learns at its next write that the job moved on and stops, instead of racing the new runner.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from coderai.contracts import VideoJob
from coderai.contracts.base import Message
from coderai.contracts.stages import Handoff, StageRun
from coderai.gateway.takeover import Superseded, Tenure

STALE_S = 60.0  # a running record not touched for this long has lost its runner (and no replica took it over)
MAX_TAKEOVERS = 3  # a job whose runner died this many times is failed rather than taken over again


class VideoRecord(Message, frozen=True, kw_only=True):
    id: str
    model: str
    prompt: str
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int = 0
    created_at: int
    updated_at: float
    completed_at: int | None = None
    size: str
    seconds: str
    key_name: str = ""
    blob: str = ""
    error: str | None = None
    error_code: str | None = None
    stage: str | None = None  # stage relay: the stage running now (encode, denoise, decode) and its node
    node: str | None = None
    stages: list[StageRun] = []  # stage relay: the stages that ran to the end, in order
    handoff: Handoff | None = None  # stage relay: what the last finished stage left, to go on from
    job: VideoJob | None = None  # what a replica needs to run the job again (seed and steps fixed once relayed)
    runner: str = ""  # the gateway running it now
    takeovers: int = 0  # how many times a replica took it over from a gateway that stopped


def running(rec: VideoRecord) -> bool:
    return rec.status in ("queued", "in_progress")


def due(rec: VideoRecord, quiet_s: float, after_s: float) -> bool:
    """A running record nobody wrote for `after_s`: its gateway stopped. `quiet_s` is measured on the sweeping
    gateway's own clock (since it last saw the record change), so clocks that differ between hosts do not matter.
    Records without a job (written before jobs were kept) cannot be run again: left to read as `runner_lost`."""
    return running(rec) and rec.job is not None and quiet_s > after_s


def claim(rec: VideoRecord, runner: str, now: float, max_takeovers: int = MAX_TAKEOVERS) -> VideoRecord:
    """The record as the replica taking the job over writes it; a job over its takeover bound comes back
    failed instead (written the same revision-checked way, so only one replica fails it)."""
    if rec.takeovers >= max_takeovers:
        return msgspec.structs.replace(
            rec,
            status="failed",
            error_code="runner_lost",
            updated_at=now,
            runner=runner,
            error=f"The gateway running this job stopped {rec.takeovers + 1} times; it was taken over "
            f"{rec.takeovers} times and is not taken over again.",
        )
    return msgspec.structs.replace(rec, runner=runner, takeovers=rec.takeovers + 1, updated_at=now)


class VideoTenure(Tenure[VideoRecord]):
    """A video runner's hold on its job's record. Nobody else changes a running job's record: a write that lost its
    race goes on only while the record is still this runner's and running."""

    record = VideoRecord

    def lost(self, current: VideoRecord, changes: dict[str, object]) -> dict[str, object]:
        if not running(current):
            raise Superseded(f"{current.id} is now run by {current.runner or 'another gateway'}")
        return changes
