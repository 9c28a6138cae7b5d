"""`/v1/videos`: text-to-video as an asynchronous job, in OpenAI's video object shape.

The gateway that accepts a job runs it in the background and keeps its record in the `coderai_videos` KV
bucket (progress included), so any gateway replica answers `GET /v1/videos/{id}`; the MP4 lands in the blob
store. A record left `in_progress` whose runner stopped updating it (its gateway died) reads as failed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Literal

import msgspec
from litestar import Request, Response, get, post
from litestar.params import FromPath

from coderai.contracts import Blob, Chunk, VideoJob
from coderai.contracts.base import Message
from coderai.contracts.stages import Handoff, StageRun
from coderai.contracts.topology import BLOBS, VIDEOS
from coderai.gateway import jobs, video_relay
from coderai.gateway import openai_types as oa
from coderai.gateway.errors import ApiError
from coderai.gateway.media_types import Form, VideoRequest, parse_size, read_form
from coderai.runtime.blobs import BlobMissing

log = logging.getLogger("coderai.gateway")

STALE_S = 60.0  # a running record not touched for this long has lost its runner
PROGRESS_EVERY_S = 0.5  # KV writes of progress are throttled to this


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


def video_routes(gw: Any, caller: Any, rid: Any) -> list:
    running: set[asyncio.Task] = set()
    bucket: list[Any] = []  # bound once: every progress write and GET would otherwise ask JetStream for it again

    async def kv() -> Any:
        if not bucket:
            bucket.append(await gw.bus.kv(VIDEOS))
        return bucket[0]

    async def save(rec: VideoRecord) -> None:
        await (await kv()).put(rec.id, msgspec.json.encode(rec))

    async def load(video_id: str) -> VideoRecord:
        from nats.js.errors import KeyNotFoundError

        if not video_id.startswith("video_") or not video_id[6:].isalnum():
            raise ApiError(404, f"No video job '{video_id}'.", param="video_id", code="not_found")
        try:
            entry = await (await kv()).get(video_id)
        except KeyNotFoundError:
            raise ApiError(404, f"No video job '{video_id}'.", param="video_id", code="not_found") from None
        return msgspec.json.decode(entry.value, type=VideoRecord)

    async def work(rec: VideoRecord, job: VideoJob, who: Any) -> None:
        last = [0.0]

        async def on_chunk(chunk: Chunk) -> None:
            nonlocal rec
            now = time.time()
            if chunk.progress is None or now - last[0] < PROGRESS_EVERY_S:
                return
            last[0] = now
            rec = msgspec.structs.replace(rec, status="in_progress", progress=min(99, int(chunk.progress * 100)),
                                          updated_at=now)
            await save(rec)

        async def update(**changes: Any) -> None:
            nonlocal rec
            rec = msgspec.structs.replace(rec, **changes, updated_at=time.time())
            await save(rec)

        try:
            if video_relay.is_staged(jobs.model_for(gw, job.model, "video")):
                done = await video_relay.run(gw, who, job, update)
                stored_name = done.video.name  # the decode node stored the MP4
            else:
                _, final = await jobs.run(gw, who, "video", job, on_chunk)
                stored_name = (await gw.blobs.put(final.output.video.data, "video/mp4", suffix=".mp4")).name
            rec = msgspec.structs.replace(rec, status="completed", progress=100, blob=stored_name,
                                          completed_at=int(time.time()), updated_at=time.time())
        except ApiError as exc:
            rec = msgspec.structs.replace(rec, status="failed", error=exc.message, error_code=exc.code,
                                          updated_at=time.time())
        except Exception as exc:  # noqa: BLE001 - the outermost edge of a background job: record it
            log.exception("video job %s failed", rec.id)
            rec = msgspec.structs.replace(rec, status="failed", error=f"{type(exc).__name__}: {exc}",
                                          updated_at=time.time())
        await save(rec)

    @post("/v1/videos", status_code=200, request_max_body_size=gw.settings.max_upload_bytes + 1024 * 1024)
    async def create(request: Request) -> Response:
        who = await caller(request)
        if request.headers.get("content-type", "").startswith("multipart/form-data"):  # what the openai SDK sends
            req = _from_form(await read_form(request, gw.settings.max_upload_bytes))
        else:
            req = oa.parse(await request.body(), VideoRequest)
        w, h, frames, seconds = plan(req)
        jobs.model_for(gw, req.model, "video")
        request_id = rid()
        job = VideoJob(request_id=request_id, model=req.model, prompt=req.prompt, num_frames=frames, width=w, height=h,
                       fps=req.fps, seed=req.seed, steps=req.steps, negative_prompt=req.negative_prompt)
        now = time.time()
        rec = VideoRecord(id=f"video_{request_id}", model=req.model, prompt=req.prompt, status="queued",
                          created_at=int(now), updated_at=now, size=f"{w}x{h}", seconds=seconds, key_name=who.key_name)
        await save(rec)
        task = asyncio.create_task(work(rec, job, who))
        running.add(task)
        task.add_done_callback(running.discard)
        return Response(content=msgspec.json.encode(video_json(rec, now)), media_type="application/json")

    @get("/v1/videos/{video_id:str}")
    async def retrieve(request: Request, video_id: FromPath[str]) -> Response:
        await caller(request)
        rec = await load(video_id)
        return Response(content=msgspec.json.encode(video_json(rec, time.time())), media_type="application/json")

    @get("/v1/videos/{video_id:str}/content")
    async def content(request: Request, video_id: FromPath[str]) -> Response:
        await caller(request)
        rec = await load(video_id)
        if rec.status != "completed":
            raise ApiError(409 if rec.status != "failed" else 400, f"Video {video_id} is {rec.status}, not completed.",
                           param="video_id", code="video_not_ready")
        try:
            data = await gw.blobs.get(Blob(name=rec.blob))
        except BlobMissing:
            raise ApiError(404, f"The content of {video_id} has expired.", code="not_found") from None
        return Response(content=data, media_type="video/mp4")

    return [create, retrieve, content]
