"""`POST /v1/images/generations` and `/v1/images/edits` (diffusers), and `GET /v1/blobs/{name}`: generated images
by URL, signed and expiring (`blob_urls.py`), under random names."""

from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Literal

import msgspec
from litestar import Request, Response, get, post
from litestar.params import FromPath
from msgspec import Meta

from coderai.contracts import Blob, ImageJob, ImageResult, RequestId
from coderai.gateway import blob_urls
from coderai.gateway.errors import ApiError
from coderai.gateway.http import json_response, new_request_id, read_json
from coderai.gateway.openai import formats
from coderai.gateway.openai.forms import NonEmpty, blob, parse_size, read_form
from coderai.gateway.pipeline import Call, answer
from coderai.gateway.state import GatewayController, InferenceController
from coderai.runtime.blobs import BlobMissing

MEDIA_TYPES = {
    "png": ("image/png", lambda d: d[:8] == b"\x89PNG\r\n\x1a\n"),
    "mp4": ("video/mp4", lambda d: d[4:8] == b"ftyp"),
}
"""What a blob is served as, by its name's suffix, when its bytes start as that type does: the media the API makes.
Anything else is a download (a node's bytes are never rendered on the gateway's origin, whatever they hold)."""
NO_RENDER = {"X-Content-Type-Options": "nosniff", "Content-Security-Policy": "default-src 'none'; sandbox"}


class ImageRequest(msgspec.Struct, kw_only=True):
    prompt: NonEmpty
    model: NonEmpty
    n: Annotated[int, Meta(ge=1, le=10)] = 1
    size: str | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    seed: int | None = None
    quality: str | None = None
    style: str | None = None
    negative_prompt: str | None = None
    steps: Annotated[int, Meta(ge=1, le=500)] | None = None
    guidance_scale: Annotated[float, Meta(ge=0, le=50)] | None = None
    user: str | None = None


class ImagesController(InferenceController):
    @post("/v1/images/generations", status_code=200)
    async def generations(self, request: Request) -> Response:
        who = self.caller(request)
        req = await read_json(request, ImageRequest)
        w, h = parse_size(req.size, (512, 512))
        job = ImageJob(
            request_id=RequestId(new_request_id()),
            model=req.model,
            prompt=req.prompt,
            n=req.n,
            width=w,
            height=h,
            seed=req.seed,
            steps=req.steps,
            guidance_scale=req.guidance_scale,
            negative_prompt=req.negative_prompt,
        )
        return await _images(Call(self.gw, who, "image", job), request, req.response_format)

    @post("/v1/images/edits", status_code=200)
    async def edits(self, request: Request) -> Response:
        who = self.caller(request)
        form = await read_form(request, self.gw.settings.max_upload_bytes, "image")
        image = form.file("image")
        mask = form.file("mask", required=False)
        size = form.get("size")
        w, h = parse_size(size, (0, 0)) if size else (0, 0)
        job = ImageJob(
            request_id=RequestId(new_request_id()),
            model=form.require("model"),
            prompt=form.require("prompt"),
            n=form.number("n", int, 1, 10, 1),
            width=w,
            height=h,
            seed=form.number("seed", int, 0, 2**63 - 1),
            steps=form.number("steps", int, 1, 500),
            strength=form.number("strength", float, 0.0, 1.0),
            image=blob(image),
            mask=blob(mask) if mask else None,
        )
        fmt = form.choice("response_format", ("b64_json", "url"), "b64_json")
        return await _images(Call(self.gw, who, "image", job), request, fmt)


class BlobsController(GatewayController):
    """No guard: the URL's signature is the credential."""

    @get("/v1/blobs/{name:str}")
    async def blob(self, request: Request, name: FromPath[str]) -> Response:
        """No key needed, but a URL this cluster signed that has not expired (`blob_urls.py`); anything else is the
        404 of a blob that is not there, so a bare name, a forged or an expired URL tells nothing."""
        q = request.query_params
        expires = q.get("expires")
        if not blob_urls.signer().valid(name, expires, q.get("signature")):
            raise ApiError(404, "No such file (it may have expired).", code="not_found")
        try:
            data = await self.gw.blobs.get(Blob(name=name))
        except (BlobMissing, ValueError):
            raise ApiError(404, "No such file (it may have expired).", code="not_found") from None
        ext = name.rsplit(".", 1)[-1] if "." in name else ""
        media_type, looks_like = MEDIA_TYPES.get(ext, ("", None))
        headers = {**NO_RENDER, "Cache-Control": f"private, max-age={max(0, int(expires or 0) - int(time.time()))}"}
        if looks_like is None or not looks_like(data):
            media_type = "application/octet-stream"
            headers["Content-Disposition"] = "attachment"
        return Response(content=data, media_type=media_type, headers=headers)


async def _images(call: Call, request: Request, response_format: str) -> Response:
    final = await answer(call, request)
    out = formats.result(final, ImageResult)
    data = []
    for img, seed in zip(out.images, out.seeds or [None] * len(out.images)):
        item: dict[str, Any] = {"revised_prompt": call.job.prompt}
        if response_format == "url":
            stored = await call.gw.blobs.put(img.data, "image/png", suffix=".png")
            item["url"] = str(request.base_url).rstrip("/") + blob_urls.signer().path(stored.name)
        else:
            item["b64_json"] = base64.b64encode(img.data).decode()
        if seed is not None:
            item["seed"] = seed
        data.append(item)
    return json_response({"created": call.created, "data": data}, headers=call.response_headers())
