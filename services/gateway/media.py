"""The media endpoints: embeddings, rerank, images, speech, transcription, translation, diarization, OCR.

Each parses and checks its request (a bad field is a 400 naming it), builds the op's job, runs it through
`jobs` and shapes the result with `formats`.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.params import FromPath
from litestar.response import Stream

from coderai.contracts import (
    Blob,
    DiarizeJob,
    EmbedJob,
    Final,
    ImageJob,
    OcrJob,
    RerankJob,
    SpeechJob,
    TranscribeJob,
)
from coderai.gateway import formats, jobs
from coderai.gateway import openai_types as oa
from coderai.gateway.errors import ApiError
from coderai.gateway.media_types import (
    EmbeddingRequest,
    Upload,
    ImageRequest,
    RerankRequest,
    SpeechRequest,
    parse_size,
    read_form,
)
from coderai.runtime.blobs import BlobMissing

AUDIO_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac", "wav": "audio/wav",
               "pcm": "audio/pcm"}
TRANSCRIPT_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
IMAGE_TYPES = {"png": "image/png", "mp4": "video/mp4"}


def _json(obj: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(content=msgspec.json.encode(obj), media_type="application/json", headers=headers)


def media_routes(gw: Any, caller: Any, rid: Any) -> list:
    """Route handlers bound to the gateway state `gw`; `caller(request)` authenticates, `rid()` makes ids."""
    upload_limit = gw.settings.max_upload_bytes + 1024 * 1024  # one file plus the form's other fields

    @post("/v1/embeddings", status_code=200)
    async def embeddings(request: Request) -> Response:
        who = await caller(request)
        req = oa.parse(await request.body(), EmbeddingRequest)
        texts = [req.input] if isinstance(req.input, str) else req.input
        if not texts:
            raise ApiError(400, "'input' must not be empty.", param="input", code="invalid_value")
        if not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "Token-id input is not supported here; send the text.", param="input",
                           code="invalid_value")
        if any(not t for t in texts):
            raise ApiError(400, "'input' must not contain empty strings.", param="input", code="invalid_value")
        job = EmbedJob(request_id=rid(), model=req.model, input=texts, dimensions=req.dimensions)  # type: ignore[arg-type]
        call, final = await jobs.run(gw, who, "embed", job)
        return _json(formats.embeddings(final.output, req.model, req.encoding_format, final.usage),
                     jobs.response_headers(call))

    @post("/v1/rerank", status_code=200)
    async def rerank(request: Request) -> Response:
        who = await caller(request)
        req = oa.parse(await request.body(), RerankRequest)
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        job = RerankJob(request_id=rid(), model=req.model, query=req.query, documents=docs)
        call, final = await jobs.run(gw, who, "rerank", job)
        body = formats.rerank(job.request_id, final.output.scores, docs, req.model, req.top_n, req.return_documents,
                              final.usage)
        return _json(body, jobs.response_headers(call))

    async def image_answer(request: Request, job: ImageJob, response_format: str, who: Any) -> Response:
        call, final = await jobs.run(gw, who, "image", job)
        data = []
        for img, seed in zip(final.output.images, final.output.seeds or [None] * len(final.output.images)):
            item: dict[str, Any] = {"revised_prompt": job.prompt}
            if response_format == "url":
                stored = await gw.blobs.put(img.data, "image/png", suffix=".png")
                item["url"] = f"{str(request.base_url).rstrip('/')}/v1/blobs/{stored.name}"
            else:
                item["b64_json"] = base64.b64encode(img.data).decode()
            if seed is not None:
                item["seed"] = seed
            data.append(item)
        return _json({"created": int(time.time()), "data": data}, jobs.response_headers(call))

    @post("/v1/images/generations", status_code=200)
    async def images(request: Request) -> Response:
        who = await caller(request)
        req = oa.parse(await request.body(), ImageRequest)
        w, h = parse_size(req.size, (512, 512))
        job = ImageJob(request_id=rid(), model=req.model, prompt=req.prompt, n=req.n, width=w, height=h, seed=req.seed,
                       steps=req.steps, guidance_scale=req.guidance_scale, negative_prompt=req.negative_prompt)
        return await image_answer(request, job, req.response_format, who)

    @post("/v1/images/edits", status_code=200, request_max_body_size=upload_limit)
    async def image_edits(request: Request) -> Response:
        who = await caller(request)
        form = await read_form(request, gw.settings.max_upload_bytes, "image")
        image = form.file("image")
        mask = form.file("mask", required=False)
        size = form.get("size")
        w, h = parse_size(size, (0, 0)) if size else (0, 0)
        job = ImageJob(
            request_id=rid(), model=form.require("model"), prompt=form.require("prompt"),
            n=form.number("n", int, 1, 10, 1), width=w, height=h, seed=form.number("seed", int, 0, 2**63 - 1),
            steps=form.number("steps", int, 1, 500), strength=form.number("strength", float, 0.0, 1.0),
            image=_blob(image), mask=_blob(mask) if mask else None,
        )
        return await image_answer(request, job, form.choice("response_format", ("b64_json", "url"), "b64_json"), who)

    @post("/v1/audio/speech", status_code=200)
    async def speech(request: Request) -> Stream:
        who = await caller(request)
        req = oa.parse(await request.body(), SpeechRequest)
        if req.stream_format == "sse":
            raise ApiError(400, "stream_format 'sse' is not supported; use 'audio'.", param="stream_format",
                           code="invalid_value")
        job = SpeechJob(request_id=rid(), model=req.model, input=req.input, voice=req.voice,
                        response_format=req.response_format, speed=req.speed)
        call = await jobs.admit(gw, who, "speech", job)
        final, decision = await jobs.fan_out(call, "speech", job)  # sentences over several workers: whole answer
        if final is not None:
            return Stream(iter([final.output.audio.data]), media_type=AUDIO_TYPES[req.response_format],
                          headers=jobs.response_headers(call))
        call.outcome.stream = True
        first = await jobs.start(call, msgspec.structs.replace(job, stream=True), decision)

        async def audio() -> AsyncIterator[bytes]:
            final: Final | None = None
            try:
                async for frame in jobs.frames(call, first):
                    if isinstance(frame, Final):
                        final = frame
                        out = frame.output
                        if out is not None and out.audio is not None:  # an engine that answered whole
                            yield await gw.blobs.get(out.audio)
                    elif frame.data:
                        yield frame.data
            except BaseException as exc:  # headers are sent: the client sees a cut stream; we account for it
                if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                    call.abandon()
                else:
                    call.fail("engine_failed", 502)
                    gw.relay.spawn(call.finish())
                raise
            gw.relay.spawn(call.finish(final))

        return Stream(audio(), media_type=AUDIO_TYPES[req.response_format], headers=jobs.response_headers(call))

    async def transcribe(request: Request, task: str) -> Response:
        who = await caller(request)
        form = await read_form(request, gw.settings.max_upload_bytes)
        audio = form.file("file")
        fmt = form.choice("response_format", TRANSCRIPT_FORMATS, "json")
        grains = form.getall("timestamp_granularities")
        for g in grains:
            if g not in ("word", "segment"):
                raise ApiError(400, f"timestamp_granularities takes 'word' and 'segment', not {g!r}.",
                               param="timestamp_granularities", code="invalid_value")
        if grains and fmt != "verbose_json":
            raise ApiError(400, "timestamp_granularities needs response_format verbose_json.",
                           param="timestamp_granularities", code="invalid_value")
        diarize = form.flag("diarize")
        job = TranscribeJob(
            request_id=rid(), model=form.require("model"), audio=_blob(audio), task=task,  # type: ignore[arg-type]
            language=form.get("language") if task == "transcribe" else None, prompt=form.get("prompt"),
            temperature=form.number("temperature", float, 0.0, 1.0, 0.0), word_timestamps="word" in grains,
        )
        if not diarize:
            call, final = await jobs.run(gw, who, "transcribe", job)
            result = final.output
        else:
            dmodel = _diarizer(form.get("diarization_model"))
            djob = DiarizeJob(request_id=rid(), model=dmodel, audio=job.audio,
                              num_speakers=form.number("num_speakers", int, 1, 32))
            (call, final), (_, dfinal) = await asyncio.gather(jobs.run(gw, who, "transcribe", job),
                                                              jobs.run(gw, who, "diarize", djob))
            result = msgspec.structs.replace(final.output, segments=formats.assign_speakers(
                final.output.segments, dfinal.output.segments))
        body, media_type = formats.transcription(result, fmt, task, grains, result.duration_s)
        content = body if isinstance(body, bytes) else msgspec.json.encode(body)
        return Response(content=content, media_type=media_type, headers=jobs.response_headers(call))

    def _diarizer(name: str | None) -> str:
        if name:
            jobs.model_for(gw, name, "diarize")
            return name
        for cfg in sorted(gw.catalog.models.values(), key=lambda m: m.name):
            if "diarize" in cfg.serves():
                return cfg.name
        raise ApiError(400, "diarize=true needs a diarization model, and none is served.", param="diarize",
                       code="no_diarization_model")

    @post("/v1/audio/transcriptions", status_code=200, request_max_body_size=upload_limit)
    async def transcriptions(request: Request) -> Response:
        return await transcribe(request, "transcribe")

    @post("/v1/audio/translations", status_code=200, request_max_body_size=upload_limit)
    async def translations(request: Request) -> Response:
        return await transcribe(request, "translate")

    @post("/v1/audio/diarization", status_code=200, request_max_body_size=upload_limit)
    async def diarization(request: Request) -> Response:
        who = await caller(request)
        form = await read_form(request, gw.settings.max_upload_bytes)
        job = DiarizeJob(request_id=rid(), model=form.require("model"), audio=_blob(form.file("file")),
                         num_speakers=form.number("num_speakers", int, 1, 32))
        call, final = await jobs.run(gw, who, "diarize", job)
        return _json(formats.diarization(final.output, job.model), jobs.response_headers(call))

    @post("/v1/ocr", status_code=200, request_max_body_size=upload_limit)
    async def ocr(request: Request) -> Response:
        who = await caller(request)
        form = await read_form(request, gw.settings.max_upload_bytes)
        job = OcrJob(request_id=rid(), model=form.require("model"), file=_blob(form.file("file")))
        call, final = await jobs.run(gw, who, "ocr", job)
        return _json(formats.ocr(final.output, job.model), jobs.response_headers(call))

    @get("/v1/blobs/{name:str}")
    async def blob(name: FromPath[str]) -> Response:
        """Generated images by URL: the name is random and unguessable (and expires), like a signed URL."""
        try:
            data = await gw.blobs.get(Blob(name=name))
        except (BlobMissing, ValueError):
            raise ApiError(404, "No such file (it may have expired).", code="not_found") from None
        ext = name.rsplit(".", 1)[-1] if "." in name else ""
        return Response(content=data, media_type=IMAGE_TYPES.get(ext, "application/octet-stream"),
                        headers={"Cache-Control": "private, max-age=3600"})

    return [embeddings, rerank, images, image_edits, speech, transcriptions, translations, diarization, ocr, blob]


def _blob(up: Upload) -> Blob:
    return Blob(data=up.data, size=len(up.data), content_type=up.content_type, filename=up.filename)
