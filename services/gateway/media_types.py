"""Wire types of the media endpoints, and the checks that turn a bad field into a 400 naming it.

JSON bodies decode into the structs below (lenient on unknown fields, strict on the ones we read); multipart
uploads (transcriptions, image edits, diarization, OCR) are read by `read_form` into plain fields and files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from coderai.gateway.errors import ApiError

NonEmpty = Annotated[str, Meta(min_length=1)]


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list[str | int | list[int]]  # token ids parse, and are refused with a clear message
    model: NonEmpty
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None


class RerankDocument(msgspec.Struct):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    model: NonEmpty
    query: NonEmpty
    documents: Annotated[list[str | RerankDocument], Meta(min_length=1, max_length=4096)]
    top_n: Annotated[int, Meta(ge=1)] | None = None
    return_documents: bool = True


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


class SpeechRequest(msgspec.Struct, kw_only=True):
    model: NonEmpty
    input: Annotated[str, Meta(min_length=1, max_length=4096)]
    voice: NonEmpty
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: Annotated[float, Meta(ge=0.25, le=4.0)] = 1.0
    instructions: str | None = None
    stream_format: Literal["audio", "sse"] | None = None


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


SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")


def parse_size(size: str | None, default: tuple[int, int], *, lo: int = 64, hi: int = 4096) -> tuple[int, int]:
    """`"WxH"` into (width, height), each in [lo, hi] and a multiple of 8 (what diffusion models need)."""
    if size is None or size == "auto":
        return default
    m = SIZE.match(size)
    if not m:
        raise ApiError(400, f"size must look like '512x512', not {size!r}.", param="size", code="invalid_size")
    w, h = int(m.group(1)), int(m.group(2))
    if not (lo <= w <= hi and lo <= h <= hi):
        raise ApiError(400, f"size {size} is out of range: width and height must be {lo} to {hi}.", param="size",
                       code="invalid_size")
    if w % 8 or h % 8:
        raise ApiError(400, f"size {size}: width and height must be multiples of 8.", param="size",
                       code="invalid_size")
    return w, h


# --- multipart -----------------------------------------------------------------------------------------


@dataclass
class Upload:
    data: bytes
    filename: str
    content_type: str


@dataclass
class Form:
    """A multipart body: text fields (repeated ones as lists, `name[]` folded into `name`) and files."""

    fields: dict[str, list[str]] = field(default_factory=dict)
    files: dict[str, Upload] = field(default_factory=dict)

    def get(self, name: str, default: str | None = None) -> str | None:
        values = self.fields.get(name)
        return values[-1] if values else default

    def getall(self, name: str) -> list[str]:
        return self.fields.get(name, [])

    def require(self, name: str) -> str:
        value = self.get(name)
        if not value:
            raise ApiError(400, f"The field '{name}' is required.", param=name, code="missing_field")
        return value

    def file(self, name: str, *, required: bool = True) -> Upload | None:
        up = self.files.get(name)
        if up is None and required:
            raise ApiError(400, f"Upload a file in the multipart field '{name}'.", param=name, code="missing_file")
        if up is not None and not up.data and required:
            raise ApiError(400, f"The file in '{name}' is empty.", param=name, code="empty_file")
        return up

    def number(self, name: str, kind: type, lo: float, hi: float, default: Any = None) -> Any:
        raw = self.get(name)
        if raw is None or raw == "":
            return default
        try:
            value = kind(raw)
        except ValueError:
            raise ApiError(400, f"'{name}' must be a number, not {raw!r}.", param=name, code="invalid_value") from None
        if not lo <= value <= hi:
            raise ApiError(400, f"'{name}' must be between {lo} and {hi}.", param=name, code="invalid_value")
        return value

    def flag(self, name: str) -> bool:
        raw = (self.get(name) or "").lower()
        if raw in ("", "false", "0", "no"):
            return False
        if raw in ("true", "1", "yes"):
            return True
        raise ApiError(400, f"'{name}' must be true or false.", param=name, code="invalid_value")

    def choice(self, name: str, allowed: tuple[str, ...], default: str) -> str:
        value = self.get(name) or default
        if value not in allowed:
            raise ApiError(400, f"'{name}' must be one of {', '.join(allowed)}; got {value!r}.", param=name,
                           code="invalid_value")
        return value


async def read_form(request: Any, max_upload_bytes: int, upload: str = "file") -> Form:
    """Parse a multipart/form-data body; a file over `max_upload_bytes` is a 413 naming its field (`upload`
    when the whole body was over the route's limit before any field could be read)."""
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("multipart/form-data"):
        raise ApiError(415, "Send this endpoint multipart/form-data (a file upload).", code="unsupported_media_type")
    try:
        form = await request.form()
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - litestar's parser raises several types for a broken body
        if getattr(exc, "status_code", None) == 413:
            raise ApiError(413, f"The upload in '{upload}' is over the {max_upload_bytes / 1e6:.0f} MB limit.",
                           param=upload, code="upload_too_large") from None
        raise ApiError(400, f"The multipart body could not be read: {exc}", code="invalid_multipart") from None
    out = Form()
    for name, value in form.multi_items():
        key = name[:-2] if name.endswith("[]") else name
        if hasattr(value, "read"):
            data = await value.read()
            if len(data) > max_upload_bytes:
                raise ApiError(413, f"The file in '{key}' is {len(data) / 1e6:.1f} MB, over the "
                                    f"{max_upload_bytes / 1e6:.0f} MB upload limit.", param=key,
                               code="upload_too_large")
            out.files[key] = Upload(data, value.filename or "", value.content_type or "application/octet-stream")
        else:
            out.fields.setdefault(key, []).append(str(value))
    return out
