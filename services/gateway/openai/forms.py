"""What the media endpoints share: sizes ("512x512"), and multipart uploads (transcriptions, image edits,
diarization, OCR, files) read by `read_form` into plain fields and files, each bad field a 400 naming it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Literal, TypeVar, overload

from litestar import Request
from litestar.datastructures import UploadFile
from msgspec import Meta

from coderai.contracts import Blob
from coderai.gateway.errors import ApiError
from coderai.gateway.http import number

NonEmpty = Annotated[str, Meta(min_length=1)]
N = TypeVar("N", int, float)


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
        raise ApiError(
            400,
            f"size {size} is out of range: width and height must be {lo} to {hi}.",
            param="size",
            code="invalid_size",
        )
    if w % 8 or h % 8:
        raise ApiError(400, f"size {size}: width and height must be multiples of 8.", param="size", code="invalid_size")
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

    @overload
    def file(self, name: str, *, required: Literal[True] = True) -> Upload: ...
    @overload
    def file(self, name: str, *, required: bool) -> Upload | None: ...
    def file(self, name: str, *, required: bool = True) -> Upload | None:
        up = self.files.get(name)
        if up is None and required:
            raise ApiError(400, f"Upload a file in the multipart field '{name}'.", param=name, code="missing_file")
        if up is not None and not up.data and required:
            raise ApiError(400, f"The file in '{name}' is empty.", param=name, code="empty_file")
        return up

    @overload
    def number(self, name: str, kind: type[N], lo: float, hi: float) -> N | None: ...
    @overload
    def number(self, name: str, kind: type[N], lo: float, hi: float, default: N) -> N: ...
    def number(self, name: str, kind: type[N], lo: float, hi: float, default: N | None = None) -> N | None:
        raw = self.get(name)
        if raw is None or raw == "":
            return default
        return number(name, raw, kind, lo, hi)

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
            raise ApiError(
                400, f"'{name}' must be one of {', '.join(allowed)}; got {value!r}.", param=name, code="invalid_value"
            )
        return value


async def read_form(request: Request, max_upload_bytes: int, upload: str = "file") -> Form:
    """Parse a multipart/form-data body; a file over `max_upload_bytes` is a 413 naming its field (`upload`
    when the whole body was over the route's limit before any field could be read)."""
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("multipart/form-data"):
        raise ApiError(415, "Send this endpoint multipart/form-data (a file upload).", code="unsupported_media_type")
    try:
        form = await request.form()
    except ApiError:
        raise
    except Exception as exc:  # litestar's parser raises several types for a broken body
        if getattr(exc, "status_code", None) == 413:
            raise ApiError(
                413,
                f"The upload in '{upload}' is over the {max_upload_bytes / 1e6:.0f} MB limit.",
                param=upload,
                code="upload_too_large",
            ) from None
        raise ApiError(400, f"The multipart body could not be read: {exc}", code="invalid_multipart") from None
    out = Form()
    for name, value in form.multi_items():
        key = name[:-2] if name.endswith("[]") else name
        if isinstance(value, UploadFile):
            data = await value.read()
            if len(data) > max_upload_bytes:
                raise ApiError(
                    413,
                    f"The file in '{key}' is {len(data) / 1e6:.1f} MB, over the "
                    f"{max_upload_bytes / 1e6:.0f} MB upload limit.",
                    param=key,
                    code="upload_too_large",
                )
            out.files[key] = Upload(data, value.filename or "", value.content_type or "application/octet-stream")
        else:
            out.fields.setdefault(key, []).append(str(value))
    return out


def blob(up: Upload) -> Blob:
    """An uploaded file as the job's blob (packed into the object store by the pipeline when big)."""
    return Blob(data=up.data, size=len(up.data), content_type=up.content_type, filename=up.filename)
