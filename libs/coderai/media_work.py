"""What an image or video job asks of a GPU: its size, denoising steps and count (images) or frames (video),
checked against the model's limits and priced by it, so a budget bounds GPU time and not only prompt text.

The work of a job is measured in megapixel-steps: width x height x steps x n for images, x frames for a video (a
video's every frame is denoised at every step). A model's `price_per_mpixel_step` (USD, in the models file) prices
it; the gateway reserves that price before the job starts (`estimate_cost`) and bills it when it ends.

The limits are the diffusers and video families' params (`engine_params.py`), read the same way by the gateway
(which refuses a job past them with a 400 naming the param, before any engine sees it) and the engines:
`max_pixels` (width x height, default 1024 x 1024), `max_steps` (default 150), `steps` (what a job that names
none runs, default 20), `max_n` (images per request, default 10) and `max_frames` (video, default 64).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

DEFAULT_STEPS = 20
DEFAULT_MAX_STEPS = 150
DEFAULT_MAX_PIXELS = 1024 * 1024
DEFAULT_MAX_FRAMES = 64
DEFAULT_MAX_N = 10
DEFAULT_SIDE = 512
"""A generation that names no size is DEFAULT_SIDE x DEFAULT_SIDE."""


class OverLimit(ValueError):
    """A job asks more than its model allows; `param` names what (size, steps, n, num_frames)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class Limits:
    """A diffusers or video model's limits, from its params."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    default_steps: int = DEFAULT_STEPS
    max_steps: int = DEFAULT_MAX_STEPS
    max_n: int = DEFAULT_MAX_N
    max_frames: int = DEFAULT_MAX_FRAMES


def limits(params: dict[str, Any]) -> Limits:
    """The limits a model's `params` set (each missing one at its default)."""

    def get(name: str, default: int) -> int:
        try:
            return int(params.get(name, default))
        except (TypeError, ValueError):
            return default

    return Limits(
        max_pixels=get("max_pixels", DEFAULT_MAX_PIXELS),
        default_steps=get("steps", DEFAULT_STEPS),
        max_steps=get("max_steps", DEFAULT_MAX_STEPS),
        max_n=get("max_n", DEFAULT_MAX_N),
        max_frames=get("max_frames", DEFAULT_MAX_FRAMES),
    )


@dataclass(frozen=True)
class Work:
    """What one job asks: `count` pictures (images) or frames (video) of width x height, `steps` steps each."""

    width: int
    height: int
    steps: int
    count: int

    @property
    def mpixel_steps(self) -> float:
        return self.width * self.height * self.steps * self.count / 1e6


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's or a JPEG's header, without decoding it; None for anything else."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        w, h = struct.unpack(">II", data[16:24])
        return w, h
    if data[:2] == b"\xff\xd8":
        i = 2
        while i + 9 <= len(data):
            if data[i] != 0xFF:
                return None
            if data[i + 1] == 0xFF:  # fill bytes before a marker, as decoders skip them
                i += 1
                continue
            marker, length = data[i + 1], struct.unpack(">H", data[i + 2 : i + 4])[0]
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a start of frame: its size
                h, w = struct.unpack(">HH", data[i + 5 : i + 9])
                return w, h
            i += 2 + length
    return None


def _steps(asked: int | None, lim: Limits) -> int:
    steps = lim.default_steps if asked is None else asked
    if not 1 <= steps <= lim.max_steps:
        raise OverLimit("steps", f"steps must be between 1 and {lim.max_steps} for this model, got {steps}.")
    return steps


def _pixels(width: int, height: int, lim: Limits) -> None:
    if width * height > lim.max_pixels:
        raise OverLimit("size", f"{width}x{height} is more than this model's {lim.max_pixels} pixels.")


def image_work(params: dict[str, Any], job: Any) -> Work:
    """An `ImageJob`'s work, every setting checked against the model's limits. An edit that names no size keeps
    its picture's (shrunk to `max_pixels`, as the engine does); a picture whose size its header does not tell is
    counted at `max_pixels`."""
    lim = limits(params)
    if not 1 <= job.n <= lim.max_n:
        raise OverLimit("n", f"n must be between 1 and {lim.max_n} for this model, got {job.n}.")
    width, height = job.width, job.height
    if (width, height) == (0, 0):
        size = image_size(job.image.data) if job.image is not None else (DEFAULT_SIDE, DEFAULT_SIDE)
        width, height = size if size else (lim.max_pixels, 1)
        if width * height > lim.max_pixels:
            width, height = lim.max_pixels, 1  # the engine shrinks it to about this many pixels
    _pixels(width, height, lim)
    return Work(width=width, height=height, steps=_steps(job.steps, lim), count=job.n)


def video_work(params: dict[str, Any], job: Any) -> Work:
    """A `VideoJob`'s work, every setting checked against the model's limits."""
    lim = limits(params)
    _pixels(job.width, job.height, lim)
    if not 1 <= job.num_frames <= lim.max_frames:
        raise OverLimit(
            "num_frames", f"num_frames must be between 1 and {lim.max_frames} for this model, got {job.num_frames}."
        )
    return Work(width=job.width, height=job.height, steps=_steps(job.steps, lim), count=job.num_frames)


def work_of(params: dict[str, Any], job: Any) -> Work | None:
    """The work of an image or video job (checked against the limits); None for any other job."""
    from coderai.contracts.media import ImageJob, VideoJob

    if isinstance(job, ImageJob):
        return image_work(params, job)
    if isinstance(job, VideoJob):
        return video_work(params, job)
    return None
