"""`POST /v1/audio/speech` (bytes streamed as the engine makes them, or whole when sentences fan out),
`/v1/audio/transcriptions` and `/translations` (with `diarize=true`, speakers from a diarization model run
alongside), and coderai's `/v1/audio/diarization`."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import msgspec
from litestar import Request, Response, post
from litestar.response import Stream
from msgspec import Meta

from coderai.contracts import (
    Chunk,
    DiarizeJob,
    DiarizeResult,
    Final,
    RequestId,
    SpeechJob,
    SpeechResult,
    TranscribeJob,
    TranscribeResult,
)
from coderai.gateway.auth import Caller
from coderai.gateway.errors import ApiError
from coderai.gateway.http import json_response, new_request_id, read_json, until_disconnect
from coderai.gateway.openai import formats
from coderai.gateway.openai.forms import Form, NonEmpty, blob, read_form
from coderai.gateway.pipeline import Call, answer, relay_stream
from coderai.gateway.state import Gateway, InferenceController

AUDIO_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
TRANSCRIPT_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")


class SpeechRequest(msgspec.Struct, kw_only=True):
    model: NonEmpty
    input: Annotated[str, Meta(min_length=1, max_length=4096)]
    voice: NonEmpty
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: Annotated[float, Meta(ge=0.25, le=4.0)] = 1.0
    instructions: str | None = None
    stream_format: Literal["audio", "sse"] | None = None


class AudioController(InferenceController):
    path = "/v1/audio"

    @post("/speech", status_code=200)
    async def speech(self, request: Request) -> Stream:
        who = self.caller(request)
        req = await read_json(request, SpeechRequest)
        if req.stream_format == "sse":
            raise ApiError(
                400, "stream_format 'sse' is not supported; use 'audio'.", param="stream_format", code="invalid_value"
            )
        job = SpeechJob(
            request_id=RequestId(new_request_id()),
            model=req.model,
            input=req.input,
            voice=req.voice,
            response_format=req.response_format,
            speed=req.speed,
        )
        call = Call(self.gw, who, "speech", job)
        await call.admit()
        first = await until_disconnect(request, call.open(stream=True))  # fanned out: whole; one engine: streamed
        media_type = AUDIO_TYPES[req.response_format]
        if isinstance(first, Final) and call.parts:
            await call.finish(first)
            audio = formats.result(first, SpeechResult).audio
            data = audio.data if audio is not None else b""
            return Stream(iter([data]), media_type=media_type, headers=call.response_headers())

        def chunk(frame: Chunk) -> bytes:
            return frame.data or b""

        async def final(frame: Final) -> bytes:
            out = frame.output  # an engine that answered whole
            return (
                await self.gw.blobs.get(out.audio) if isinstance(out, SpeechResult) and out.audio is not None else b""
            )

        return Stream(relay_stream(call, first, chunk, final), media_type=media_type, headers=call.response_headers())

    @post("/transcriptions", status_code=200)
    async def transcriptions(self, request: Request) -> Response:
        who = self.caller(request)
        return await _transcribe(self.gw, who, request, "transcribe")

    @post("/translations", status_code=200)
    async def translations(self, request: Request) -> Response:
        who = self.caller(request)
        return await _transcribe(self.gw, who, request, "translate")

    @post("/diarization", status_code=200)
    async def diarization(self, request: Request) -> Response:
        who = self.caller(request)
        form = await read_form(request, self.gw.settings.max_upload_bytes)
        job = DiarizeJob(
            request_id=RequestId(new_request_id()),
            model=form.require("model"),
            audio=blob(form.file("file")),
            num_speakers=form.number("num_speakers", int, 1, 32),
        )
        call = Call(self.gw, who, "diarize", job)
        final = await answer(call, request)
        return json_response(
            formats.diarization(formats.result(final, DiarizeResult), job.model), headers=call.response_headers()
        )


async def _transcribe(gw: Gateway, who: Caller, request: Request, task: Literal["transcribe", "translate"]) -> Response:
    form = await read_form(request, gw.settings.max_upload_bytes)
    fmt = form.choice("response_format", TRANSCRIPT_FORMATS, "json")
    grains = _granularities(form, fmt)
    job = TranscribeJob(
        request_id=RequestId(new_request_id()),
        model=form.require("model"),
        audio=blob(form.file("file")),
        task=task,
        language=form.get("language") if task == "transcribe" else None,
        prompt=form.get("prompt"),
        temperature=form.number("temperature", float, 0.0, 1.0, 0.0),
        word_timestamps="word" in grains,
    )
    call = Call(gw, who, "transcribe", job)
    if not form.flag("diarize"):
        result = formats.result(await answer(call, request), TranscribeResult)
    else:
        djob = DiarizeJob(
            request_id=RequestId(new_request_id()),
            model=await _diarizer(gw, form.get("diarization_model")),
            audio=job.audio,
            num_speakers=form.number("num_speakers", int, 1, 32),
        )
        both = asyncio.gather(answer(call), answer(Call(gw, who, "diarize", djob)))
        final, dfinal = await until_disconnect(request, both)
        words, turns = formats.result(final, TranscribeResult), formats.result(dfinal, DiarizeResult)
        result = msgspec.structs.replace(words, segments=formats.assign_speakers(words.segments, turns.segments))
    body, media_type = formats.transcription(result, fmt, task, grains, result.duration_s)
    content = body if isinstance(body, bytes) else msgspec.json.encode(body)
    return Response(content=content, media_type=media_type, headers=call.response_headers())


def _granularities(form: Form, fmt: str) -> list[str]:
    grains = form.getall("timestamp_granularities")
    for g in grains:
        if g not in ("word", "segment"):
            raise ApiError(
                400,
                f"timestamp_granularities takes 'word' and 'segment', not {g!r}.",
                param="timestamp_granularities",
                code="invalid_value",
            )
    if grains and fmt != "verbose_json":
        raise ApiError(
            400,
            "timestamp_granularities needs response_format verbose_json.",
            param="timestamp_granularities",
            code="invalid_value",
        )
    return grains


async def _diarizer(gw: Gateway, name: str | None) -> str:
    if name:
        return (await gw.find_model(name, "diarize")).name
    if not await gw.catalog.wait_complete(gw.settings.failover_wait_s):  # "none is served" only from a whole view
        raise gw.not_ready()
    cfg = gw.first_model("diarize")
    if cfg is None:
        raise ApiError(
            400,
            "diarize=true needs a diarization model, and none is served.",
            param="diarize",
            code="no_diarization_model",
        )
    return cfg.name
