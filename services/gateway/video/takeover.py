"""The video jobs one gateway runs, and its sweeper: the replica that takes over jobs whose gateway stopped
(`records.py` says how a record changes hands). A staged model's job runs stage by stage (`relay.py`); any other
runs whole on one engine, through the pipeline."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
from nats.js.kv import KeyValue

from coderai.contracts import Chunk, VideoJob, VideoResult
from coderai.contracts.topology import VIDEOS
from coderai.gateway.auth import Caller
from coderai.gateway.errors import ApiError
from coderai.gateway.pipeline import Call, answer
from coderai.gateway import takeover
from coderai.gateway.video import records, relay
from coderai.gateway.video.records import STALE_S, VideoRecord, VideoTenure, claim, due
from coderai.gateway.state import Gateway
from coderai.gateway.takeover import Superseded, Takeovers

log = logging.getLogger("coderai.gateway")

PROGRESS_EVERY_S = 0.5  # KV writes of progress are throttled to this


class VideoJobs(Takeovers[VideoRecord]):
    """The video jobs this gateway runs, and its sweeper: the replica that takes over jobs whose gateway stopped
    (`coderai.gateway.takeover`)."""

    bucket, record, what = VIDEOS, VideoRecord, "video job"

    def __init__(self, gw: Gateway) -> None:
        super().__init__(gw, min(max(1.0, gw.settings.video_takeover_s), STALE_S / 2))
        self.bucket_kv: list[
            KeyValue
        ] = []  # bound once: every progress write and GET would otherwise ask JetStream for it

    def live(self, rec: VideoRecord) -> bool:
        return records.running(rec)

    def due(self, rec: VideoRecord, quiet_s: float) -> bool:
        return due(rec, quiet_s, self.after_s)

    def claim(self, rec: VideoRecord) -> VideoRecord:
        return claim(rec, self.me, time.time())

    async def kv(self) -> Any:  # the bucket's KeyValue (openai/videos.py decodes its entries' values unchecked)
        if not self.bucket_kv:
            self.bucket_kv.append(await self.gw.bus.kv(VIDEOS))
        return self.bucket_kv[0]

    async def create(self, rec: VideoRecord, job: VideoJob, who: Caller) -> None:
        rec = msgspec.structs.replace(rec, job=job, runner=self.me)
        revision = await (await self.kv()).create(rec.id, msgspec.json.encode(rec))
        self.spawn(VideoTenure(await self.kv(), rec, revision), job, who)

    def spawn(self, tenure: VideoTenure, job: VideoJob, who: Caller) -> None:
        self.track(tenure.rec.id, asyncio.create_task(self.work(tenure, job, who)))

    async def keepalive(
        self, tenure: VideoTenure, job_task: asyncio.Task, who: Caller | None = None, revoked: list[bool] | None = None
    ) -> None:
        """Touch the record while the job runs (`takeover.keepalive`), and ask after its key at each tick: a revoked
        key's job is stopped (`revoked` says so to the job)."""

        async def key_revoked() -> bool:
            if who is None or not await self.gw.auth.revoked(who):
                return False
            log.info("video job %s: key %s was revoked; stopping it", tenure.rec.id, who.key_name)
            if revoked is not None:
                revoked.append(True)
            return True

        await takeover.keepalive(tenure, job_task, self.touch_every_s, self.what, key_revoked)

    async def work(self, tenure: VideoTenure, job: VideoJob, who: Caller) -> None:
        gw, rec = self.gw, tenure.rec
        revoked: list[bool] = []
        me = asyncio.current_task()
        assert me is not None  # `spawn` runs the job as its own task
        keep = asyncio.create_task(self.keepalive(tenure, me, who, revoked))
        last = [0.0]

        async def on_chunk(chunk: Chunk) -> None:
            now = time.time()
            if chunk.progress is None or now - last[0] < PROGRESS_EVERY_S:
                return
            last[0] = now
            await tenure.save(status="in_progress", progress=min(99, int(chunk.progress * 100)))

        try:
            try:
                if relay.is_staged(await gw.find_model(job.model, "video")):
                    video = await relay.run(gw, who, job, tenure.save, handoff=rec.handoff, history=list(rec.stages))
                    stored_name = video.name  # the decode node stored the MP4
                else:
                    final = await answer(Call(gw, who, "video", job), on_chunk=on_chunk)
                    out = final.output
                    if not isinstance(out, VideoResult):
                        raise ApiError(
                            502, "The engine answered without a VideoResult.", type="engine_error", code="engine_failed"
                        )
                    stored_name = (await gw.blobs.put(out.video.data, "video/mp4", suffix=".mp4")).name
                end: dict[str, object] = dict(
                    status="completed", progress=100, blob=stored_name, completed_at=int(time.time())
                )
            except Superseded:
                raise
            except asyncio.CancelledError:
                if not revoked:  # the gateway stops: another takes the job over
                    raise
                me.uncancel()
                end = dict(status="failed", error="This API key has been revoked.", error_code="key_revoked")
            except ApiError as exc:
                end = dict(status="failed", error=exc.message, error_code=exc.code)
            except Exception as exc:  # the outermost edge of a background job: record it
                log.exception("video job %s failed", rec.id)
                end = dict(status="failed", error=f"{type(exc).__name__}: {exc}")
            keep.cancel()
            await tenure.save(**end)
        except Superseded as exc:
            log.warning("video job %s: %s; stopping here", rec.id, exc)
        finally:
            keep.cancel()

    async def resume(self, kv: KeyValue, was: VideoRecord, taken: VideoRecord, revision: int) -> None:
        if taken.status == "failed":
            log.warning("video job %s lost its gateway again; failed after %d takeovers", taken.id, was.takeovers)
            return
        log.warning(
            "video job %s: its gateway %s stopped; taken over (takeover %d, %d stages done)",
            taken.id,
            was.runner or "?",
            taken.takeovers,
            len(taken.stages),
        )
        tenure = VideoTenure(kv, taken, revision)
        try:
            who = await takeover.caller_for(self.gw.auth, taken.key_name)
        except Exception as exc:  # the key store is down: fail the job rather than hang it
            await tenure.save(
                status="failed",
                error=f"Could not look up key {taken.key_name}: {exc}",
                error_code="key_store_unavailable",
            )
            return
        assert taken.job is not None
        self.spawn(tenure, taken.job, who)
