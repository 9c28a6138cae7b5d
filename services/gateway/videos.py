"""`/v1/videos`: text-to-video as an asynchronous job, in OpenAI's video object shape.

The gateway that accepts a job runs it in the background and keeps its record in the `coderai_videos` KV
bucket (progress included), so any gateway replica answers `GET /v1/videos/{id}`; the MP4 lands in the blob
store. The record also carries the job itself, so when its gateway dies another replica takes it over
(`video_jobs.py`: the runner touches the record every few seconds, every replica sweeps for untouched ones).
A record left running that nobody took over for `STALE_S` reads as failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.params import FromPath
from nats.js.errors import KeyWrongLastSequenceError

from coderai.contracts import Blob, Chunk, RequestId, VideoJob
from coderai.contracts.topology import BLOBS, VIDEOS
from coderai.gateway import jobs, video_jobs, video_relay
from coderai.gateway import openai_types as oa
from coderai.gateway.errors import ApiError
from coderai.gateway.media_types import Form, VideoRequest, parse_size, read_form
from coderai.gateway.video_jobs import STALE_S, Superseded, Tenure, VideoRecord, claim, due
from coderai.runtime.blobs import BlobMissing
from coderai.runtime.mirror import KVMirror

log = logging.getLogger("coderai.gateway")

PROGRESS_EVERY_S = 0.5  # KV writes of progress are throttled to this


def video_json(rec: VideoRecord, now: float) -> dict[str, Any]:
    """The OpenAI video object; a running record whose runner went quiet is reported failed."""
    status, error = rec.status, None
    if rec.status in ("queued", "in_progress") and now - rec.updated_at > STALE_S:
        status, error = "failed", {"code": "runner_lost", "message": "The gateway running this job stopped."}
    elif rec.status == "failed":
        error = {"code": rec.error_code or "engine_failed", "message": rec.error or "The job failed."}
    return {
        "id": rec.id, "object": "video", "model": rec.model, "status": status, "progress": rec.progress,
        "created_at": rec.created_at, "completed_at": rec.completed_at,
        "expires_at": (rec.completed_at + int(BLOBS.ttl_s)) if rec.completed_at else None,
        "size": rec.size, "seconds": rec.seconds, "prompt": rec.prompt, "error": error,
        "stage": rec.stage, "node": rec.node,  # extensions: where a relayed job is, and where it has been
        "stages": [{"kind": s.kind, "start": s.start, "end": s.end, "node": s.node, "duration_s": s.duration_s}
                   for s in rec.stages],
        "takeovers": rec.takeovers,  # extension: how many times another gateway took the job over
    }


def plan(req: VideoRequest) -> tuple[int, int, int, str]:
    """(width, height, frames, seconds) from the request: frames = seconds x fps unless given."""
    w, h = parse_size(req.size, (256, 256), lo=16, hi=2048)
    if req.num_frames is not None:
        frames = req.num_frames
    else:
        try:
            secs = float(req.seconds) if req.seconds is not None else 1.0
        except ValueError:
            raise ApiError(400, f"seconds must be a number, not {req.seconds!r}.", param="seconds",
                           code="invalid_value") from None
        if not 0 < secs <= 60:
            raise ApiError(400, "seconds must be more than 0 and at most 60.", param="seconds", code="invalid_value")
        frames = max(1, math.ceil(secs * req.fps))
    seconds = f"{frames / req.fps:g}"
    return w, h, frames, seconds


def _from_form(form: Form) -> VideoRequest:
    if "input_reference" in form.files:
        raise ApiError(400, "input_reference (image-to-video) is not supported yet; send a text prompt.",
                       param="input_reference", code="unsupported_parameter")
    return VideoRequest(
        model=form.require("model"), prompt=form.require("prompt"), seconds=form.get("seconds"), size=form.get("size"),
        fps=form.number("fps", int, 1, 60, 8), num_frames=form.number("num_frames", int, 1, 1024),
        seed=form.number("seed", int, 0, 2**63 - 1), steps=form.number("steps", int, 1, 500),
        negative_prompt=form.get("negative_prompt"),
    )


class VideoJobs:
    """The video jobs this gateway runs, and its sweeper: the replica that takes over jobs whose gateway stopped.

    Enter `lifespan` after the gateway's own (the bus must be up); leaving it stops the sweeper and the jobs
    running here, which other replicas then take over.
    """

    def __init__(self, gw: Any) -> None:
        self.gw = gw
        self.me = f"{gw.settings.node_id or 'gateway'}:{os.getpid()}:{secrets.token_hex(3)}"
        self.after_s = min(max(1.0, gw.settings.video_takeover_s), STALE_S / 2)
        self.touch_every_s = min(5.0, self.after_s / 4)  # a live runner is never mistaken for a dead one
        self.sweep_every_s = min(5.0, self.after_s / 4)
        self.running: set[asyncio.Task] = set()
        self.bucket: list[Any] = []  # bound once: every progress write and GET would otherwise ask JetStream for it
        self.mirror: KVMirror | None = None
        self.seen: dict[str, float] = {}  # record id -> when this gateway last saw it change (monotonic)

    async def kv(self) -> Any:
        if not self.bucket:
            self.bucket.append(await self.gw.bus.kv(VIDEOS))
        return self.bucket[0]

    async def create(self, rec: VideoRecord, job: VideoJob, who: Any) -> None:
        rec = msgspec.structs.replace(rec, job=job, runner=self.me)
        revision = await (await self.kv()).create(rec.id, msgspec.json.encode(rec))
        self.spawn(Tenure(await self.kv(), rec, revision), job, who)

    def spawn(self, tenure: Tenure, job: VideoJob, who: Any) -> None:
        task = asyncio.create_task(self.work(tenure, job, who))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def keepalive(self, tenure: Tenure, job_task: asyncio.Task) -> None:
        """Touch the record while the job runs, so that no replica takes a live job for abandoned."""
        while True:
            await asyncio.sleep(self.touch_every_s)
            if time.time() - tenure.rec.updated_at < self.touch_every_s:
                continue  # the job's own writes kept it fresh
            try:
                await tenure.save()
            except Superseded as exc:
                log.warning("video job %s: %s; stopping here", tenure.rec.id, exc)
                job_task.cancel()
                return
            except Exception as exc:  # noqa: BLE001 - the bus blinked: try again at the next tick
                log.warning("video job %s: could not touch its record (%s)", tenure.rec.id, exc)

    async def work(self, tenure: Tenure, job: VideoJob, who: Any) -> None:
        gw, rec = self.gw, tenure.rec
        keep = asyncio.create_task(self.keepalive(tenure, asyncio.current_task()))
        last = [0.0]

        async def on_chunk(chunk: Chunk) -> None:
            now = time.time()
            if chunk.progress is None or now - last[0] < PROGRESS_EVERY_S:
                return
            last[0] = now
            await tenure.save(status="in_progress", progress=min(99, int(chunk.progress * 100)))

        try:
            try:
                if video_relay.is_staged(jobs.model_for(gw, job.model, "video")):
                    done = await video_relay.run(gw, who, job, tenure.save, handoff=rec.handoff,
                                                 history=list(rec.stages))
                    stored_name = done.video.name  # the decode node stored the MP4
                else:
                    _, final = await jobs.run(gw, who, "video", job, on_chunk)
                    stored_name = (await gw.blobs.put(final.output.video.data, "video/mp4", suffix=".mp4")).name
                end: dict[str, Any] = dict(status="completed", progress=100, blob=stored_name,
                                           completed_at=int(time.time()))
            except Superseded:
                raise
            except ApiError as exc:
                end = dict(status="failed", error=exc.message, error_code=exc.code)
            except Exception as exc:  # noqa: BLE001 - the outermost edge of a background job: record it
                log.exception("video job %s failed", rec.id)
                end = dict(status="failed", error=f"{type(exc).__name__}: {exc}")
            keep.cancel()
            await tenure.save(**end)
        except Superseded as exc:
            log.warning("video job %s: %s; stopping here", rec.id, exc)
        finally:
            keep.cancel()

    async def sweep(self) -> None:
        """Claim every record due for takeover (one revision-checked write each: one replica wins) and run it."""
        assert self.mirror is not None
        kv = await self.kv()
        for key, rec in list(self.mirror.values.items()):
            if not due(rec, time.monotonic() - self.seen.get(key, time.monotonic()), self.after_s):
                continue
            taken = claim(rec, self.me, time.time())
            try:
                revision = await kv.update(key, msgspec.json.encode(taken), last=self.mirror.revisions[key])
            except KeyWrongLastSequenceError:
                continue  # its runner wrote, or another replica claimed it first
            self.mirror.remember(key, taken, revision)
            self.seen[key] = time.monotonic()
            if taken.status == "failed":
                log.warning("video job %s lost its gateway again; failed after %d takeovers", key, rec.takeovers)
                continue
            log.warning("video job %s: its gateway %s stopped; taken over (takeover %d, %d stages done)",
                        key, rec.runner or "?", taken.takeovers, len(taken.stages))
            tenure = Tenure(kv, taken, revision)
            try:
                who = await video_jobs.caller_for(self.gw, taken.key_name)
            except Exception as exc:  # noqa: BLE001 - the key store is down: fail the job rather than hang it
                await tenure.save(status="failed", error=f"Could not look up key {taken.key_name}: {exc}",
                                  error_code="key_store_unavailable")
                continue
            assert taken.job is not None
            self.spawn(tenure, taken.job, who)

    async def sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_every_s)
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the bus blinked: sweep again at the next tick
                log.warning("video sweep failed: %s", exc)

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Any) -> AsyncIterator[None]:
        def changed(key: str, rec: VideoRecord | None) -> None:
            if rec is None or not video_jobs.running(rec):
                self.seen.pop(key, None)
            else:
                self.seen[key] = time.monotonic()

        self.mirror = KVMirror(self.gw.bus, VIDEOS, VideoRecord, on_change=changed)
        self.mirror.start()
        self.gw.reconnect_hooks.append(self.mirror.start)  # a restarted server may have dropped the watch
        sweeper = asyncio.create_task(self.sweeper())
        try:
            yield
        finally:
            sweeper.cancel()
            self.mirror.stop()
            for task in list(self.running):
                task.cancel()
            await asyncio.gather(sweeper, *self.running, return_exceptions=True)


def video_routes(gw: Any, caller: Any, rid: Any, videos: VideoJobs) -> list:
    async def load(video_id: str) -> VideoRecord:
        from nats.js.errors import KeyNotFoundError

        if not video_id.startswith("video_") or not video_id[6:].isalnum():
            raise ApiError(404, f"No video job '{video_id}'.", param="video_id", code="not_found")
        try:
            entry = await (await videos.kv()).get(video_id)
        except KeyNotFoundError:
            raise ApiError(404, f"No video job '{video_id}'.", param="video_id", code="not_found") from None
        return msgspec.json.decode(entry.value, type=VideoRecord)

    async def own(request: Request, video_id: str) -> VideoRecord:
        """The caller's video job; another key's is a 404 as an unknown one (an admin key sees every one)."""
        who = await caller(request)
        rec = await load(video_id)
        if "admin" not in who.scopes and rec.key_name != who.key_name:
            raise ApiError(404, f"No video job '{video_id}'.", param="video_id", code="not_found")
        return rec

    @post("/v1/videos", status_code=200, request_max_body_size=gw.settings.max_upload_bytes + 1024 * 1024)
    async def create(request: Request) -> Response:
        who = await caller(request)
        if request.headers.get("content-type", "").startswith("multipart/form-data"):  # what the openai SDK sends
            req = _from_form(await read_form(request, gw.settings.max_upload_bytes))
        else:
            req = oa.parse(await request.body(), VideoRequest)
        w, h, frames, seconds = plan(req)
        jobs.model_for(gw, req.model, "video")
        # the job's own id, random: the request ids are a counter, which would let a key guess its neighbours' videos
        request_id = RequestId(secrets.token_hex(12))
        job = VideoJob(request_id=request_id, model=req.model, prompt=req.prompt, num_frames=frames, width=w, height=h,
                       fps=req.fps, seed=req.seed, steps=req.steps, negative_prompt=req.negative_prompt)
        now = time.time()
        rec = VideoRecord(id=f"video_{request_id}", model=req.model, prompt=req.prompt, status="queued",
                          created_at=int(now), updated_at=now, size=f"{w}x{h}", seconds=seconds, key_name=who.key_name)
        await videos.create(rec, job, who)
        return Response(content=msgspec.json.encode(video_json(rec, now)), media_type="application/json")

    @get("/v1/videos/{video_id:str}")
    async def retrieve(request: Request, video_id: FromPath[str]) -> Response:
        rec = await own(request, video_id)
        return Response(content=msgspec.json.encode(video_json(rec, time.time())), media_type="application/json")

    @get("/v1/videos/{video_id:str}/content")
    async def content(request: Request, video_id: FromPath[str]) -> Response:
        rec = await own(request, video_id)
        if rec.status != "completed":
            raise ApiError(409 if rec.status != "failed" else 400, f"Video {video_id} is {rec.status}, not completed.",
                           param="video_id", code="video_not_ready")
        try:
            data = await gw.blobs.get(Blob(name=rec.blob))
        except BlobMissing:
            raise ApiError(404, f"The content of {video_id} has expired.", code="not_found") from None
        return Response(content=data, media_type="video/mp4")

    return [create, retrieve, content]
