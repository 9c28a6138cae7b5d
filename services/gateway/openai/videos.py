"""`/v1/videos`: text-to-video as an asynchronous job, in OpenAI's video object shape.

The gateway that accepts a job runs it in the background and keeps its record in the `coderai_videos` KV
bucket (progress included), so any gateway replica answers `GET /v1/videos/{id}`; the MP4 lands in the blob
store. The record also carries the job itself, so when its gateway dies another replica takes it over
(`video/`: the runner touches the record every few seconds, every replica sweeps for untouched ones).
A record left running that nobody took over for `STALE_S` reads as failed.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, get, post
from litestar.params import FromPath
from msgspec import Meta

from coderai.contracts import Blob, RequestId, VideoJob
from coderai.contracts.topology import BLOBS
from coderai.gateway.accounting import allowed, checked_work
from coderai.gateway.auth import Caller
from coderai.gateway.errors import ApiError
from coderai.gateway.http import json_response, new_request_id, read_json
from coderai.gateway.openai.forms import Form, NonEmpty, parse_size, read_form
from coderai.gateway.state import InferenceController
from coderai.gateway.video.records import STALE_S, VideoRecord
from coderai.gateway.video.takeover import VideoJobs
from coderai.runtime.blobs import BlobMissing


class VideoRequest(msgspec.Struct, kw_only=True):
    """OpenAI's `POST /v1/videos` (Sora shape), with the knobs an open model takes as extensions."""

    model: NonEmpty
    prompt: NonEmpty
    seconds: str | int | float | None = None
    size: str | None = None
    fps: Annotated[int, Meta(ge=1, le=60)] = 8
    num_frames: Annotated[int, Meta(ge=1, le=1024)] | None = None
    seed: int | None = None
    steps: Annotated[int, Meta(ge=1, le=500)] | None = None
    negative_prompt: str | None = None


def video_json(rec: VideoRecord, now: float) -> dict[str, Any]:
    """The OpenAI video object; a running record whose runner went quiet is reported failed."""
    status, error = rec.status, None
    if rec.status in ("queued", "in_progress") and now - rec.updated_at > STALE_S:
        status, error = "failed", {"code": "runner_lost", "message": "The gateway running this job stopped."}
    elif rec.status == "failed":
        error = {"code": rec.error_code or "engine_failed", "message": rec.error or "The job failed."}
    return {
        "id": rec.id,
        "object": "video",
        "model": rec.model,
        "status": status,
        "progress": rec.progress,
        "created_at": rec.created_at,
        "completed_at": rec.completed_at,
        "expires_at": (rec.completed_at + int(BLOBS.ttl_s)) if rec.completed_at else None,
        "size": rec.size,
        "seconds": rec.seconds,
        "prompt": rec.prompt,
        "error": error,
        "stage": rec.stage,
        "node": rec.node,  # extensions: where a relayed job is, and where it has been
        "stages": [
            {"kind": s.kind, "start": s.start, "end": s.end, "node": s.node, "duration_s": s.duration_s}
            for s in rec.stages
        ],
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
            raise ApiError(
                400, f"seconds must be a number, not {req.seconds!r}.", param="seconds", code="invalid_value"
            ) from None
        if not 0 < secs <= 60:
            raise ApiError(400, "seconds must be more than 0 and at most 60.", param="seconds", code="invalid_value")
        frames = max(1, math.ceil(secs * req.fps))
    seconds = f"{frames / req.fps:g}"
    return w, h, frames, seconds


def _from_form(form: Form) -> VideoRequest:
    if "input_reference" in form.files:
        raise ApiError(
            400,
            "input_reference (image-to-video) is not supported yet; send a text prompt.",
            param="input_reference",
            code="unsupported_parameter",
        )
    return VideoRequest(
        model=form.require("model"),
        prompt=form.require("prompt"),
        seconds=form.get("seconds"),
        size=form.get("size"),
        fps=form.number("fps", int, 1, 60, 8),
        num_frames=form.number("num_frames", int, 1, 1024),
        seed=form.number("seed", int, 0, 2**63 - 1),
        steps=form.number("steps", int, 1, 500),
        negative_prompt=form.get("negative_prompt"),
    )


class VideosController(InferenceController):
    path = "/v1/videos"
    videos: VideoJobs

    @post("/", status_code=200)
    async def create(self, request: Request) -> Response:
        who = self.caller(request)
        if request.headers.get("content-type", "").startswith("multipart/form-data"):  # what the openai SDK sends
            req = _from_form(await read_form(request, self.gw.settings.max_upload_bytes))
        else:
            req = await read_json(request, VideoRequest)
        w, h, frames, seconds = plan(req)
        allowed(who, req.model)  # refused now, not as a failed job (rates and budget count when the job runs)
        cfg = await self.gw.find_model(req.model, "video")
        allowed(who, req.model, cfg.owner)
        # the job's own id, random, as every request id: a key cannot guess its neighbours' videos
        request_id = RequestId(new_request_id())
        job = VideoJob(
            request_id=request_id,
            model=req.model,
            prompt=req.prompt,
            num_frames=frames,
            width=w,
            height=h,
            fps=req.fps,
            seed=req.seed,
            steps=req.steps,
            negative_prompt=req.negative_prompt,
        )
        checked_work(cfg, job)  # frames x pixels x steps within the model's limits (a 400 naming the param)
        await self.gw.accounts.check_budget(who, cfg, job)  # and within the key's budget now: a 429, not a failed job
        now = time.time()
        rec = VideoRecord(
            id=f"video_{request_id}",
            model=req.model,
            prompt=req.prompt,
            status="queued",
            created_at=int(now),
            updated_at=now,
            size=f"{w}x{h}",
            seconds=seconds,
            key_name=who.key_name,
        )
        await self.videos.create(rec, job, who)
        return json_response(video_json(rec, now))

    @get("/{video_id:str}")
    async def retrieve(self, request: Request, video_id: FromPath[str]) -> Response:
        who = self.caller(request)
        return json_response(video_json(await _own(self.videos, who, video_id), time.time()))

    @get("/{video_id:str}/content")
    async def content(self, request: Request, video_id: FromPath[str]) -> Response:
        who = self.caller(request)
        rec = await _own(self.videos, who, video_id)
        if rec.status != "completed":
            raise ApiError(
                409 if rec.status != "failed" else 400,
                f"Video {video_id} is {rec.status}, not completed.",
                param="video_id",
                code="video_not_ready",
            )
        try:
            data = await self.gw.blobs.get(Blob(name=rec.blob))
        except BlobMissing:
            raise ApiError(404, f"The content of {video_id} has expired.", code="not_found") from None
        return Response(content=data, media_type="video/mp4")


async def _own(videos: VideoJobs, who: Caller, video_id: str) -> VideoRecord:
    """The caller's video job; another key's is a 404 as an unknown one (an admin key sees every one)."""
    from nats.js.errors import KeyNotFoundError

    missing = ApiError(404, f"No video job '{video_id}'.", param="video_id", code="not_found")
    if not video_id.startswith("video_") or not video_id[6:].isalnum():
        raise missing
    try:
        entry = await (await videos.kv()).get(video_id)
    except KeyNotFoundError:
        raise missing from None
    rec = msgspec.json.decode(entry.value, type=VideoRecord)
    if "admin" not in who.scopes and rec.key_name != who.key_name:
        raise missing
    return rec
