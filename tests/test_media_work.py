"""Images and videos measured by the work they ask for, against their model's limits (`coderai.media_work`)."""

from __future__ import annotations

import struct
import zlib

import pytest

from coderai.contracts import Blob, ImageJob, ModelConfig, VideoJob
from coderai.media_work import (
    DEFAULT_MAX_PIXELS,
    OverLimit,
    Work,
    image_size,
    image_work,
    video_work,
    work_of,
)


def _png(w: int, h: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))


def _jpeg(w: int, h: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00" + b"\x00" * 9
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, h, w, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + sof + b"\xff\xd9"


def img(**kw) -> ImageJob:
    return ImageJob(request_id="r", model="m", prompt="p", **kw)


def test_an_image_is_pixels_x_steps_x_n_at_the_models_defaults():
    assert image_work({}, img()) == Work(width=512, height=512, steps=20, count=1)
    w = image_work({"steps": 4}, img(width=64, height=128, n=3))
    assert w == Work(width=64, height=128, steps=4, count=3) and w.mpixel_steps == 64 * 128 * 4 * 3 / 1e6
    assert image_work({}, img(width=64, height=64, steps=7)).steps == 7


def test_an_edit_is_counted_at_its_pictures_size_or_the_models_most():
    assert image_size(_png(300, 200)) == (300, 200) and image_size(_jpeg(640, 480)) == (640, 480)
    assert image_size(_jpeg(640, 480).replace(b"\xff\xc0", b"\xff\xff\xff\xc0", 1)) == (640, 480)  # fill bytes
    assert image_size(b"GIF89a....") is None and image_size(b"") is None
    assert image_work({}, img(image=Blob(data=_png(300, 200)))).width == 300
    assert image_work({}, img(image=Blob(data=_jpeg(640, 480)))).height == 480
    unknown = image_work({}, img(image=Blob(data=b"RIFF....WEBP")))
    assert unknown.width * unknown.height == DEFAULT_MAX_PIXELS
    huge = image_work({}, img(image=Blob(data=_png(4000, 4000))))  # the engine shrinks it to max_pixels
    assert huge.width * huge.height == DEFAULT_MAX_PIXELS


@pytest.mark.parametrize(
    "params, job, param",
    [
        ({}, img(width=4096, height=4096), "size"),
        ({"max_pixels": 64 * 64}, img(width=64, height=72), "size"),
        ({}, img(width=64, height=64, steps=151), "steps"),
        ({"max_steps": 10}, img(width=64, height=64, steps=11), "steps"),
        ({"steps": 30, "max_steps": 10}, img(width=64, height=64), "steps"),
        ({"max_n": 2}, img(width=64, height=64, n=3), "n"),
    ],
)
def test_an_image_past_its_models_limits_names_the_param(params, job, param):
    with pytest.raises(OverLimit) as err:
        image_work(params, job)
    assert err.value.param == param and err.value.message


def test_a_video_is_frames_x_pixels_x_steps_within_the_models_limits():
    job = VideoJob(request_id="r", model="m", prompt="p", num_frames=16, width=256, height=128, steps=5)
    assert video_work({}, job) == Work(width=256, height=128, steps=5, count=16)
    with pytest.raises(OverLimit) as err:
        video_work({"max_frames": 8}, job)
    assert err.value.param == "num_frames"
    with pytest.raises(OverLimit) as err:
        video_work({"max_pixels": 128 * 128}, job)
    assert err.value.param == "size"
    assert work_of({}, job) is not None and work_of({}, object()) is None


def test_the_models_price_reserves_and_bills_the_work():
    from coderai.contracts import Usage
    from coderai.gateway.pricing import checked_work, estimate_cost, price

    cfg = ModelConfig(name="m", engine="diffusers", path="/x", price_per_mpixel_step=2.0, params={"steps": 2})
    huge = img(width=1024, height=1024, n=10, steps=150)
    assert estimate_cost(cfg, huge) == pytest.approx(1024 * 1024 * 150 * 10 / 1e6 * 2.0)
    small = img(width=64, height=64)
    work = checked_work(cfg, small)
    assert price(cfg, Usage(prompt_tokens=5), work) == pytest.approx(64 * 64 * 2 / 1e6 * 2.0)
    assert estimate_cost(cfg, small) >= price(cfg, Usage(prompt_tokens=5), work)
    assert price(cfg, Usage(prompt_tokens=5)) == 0.0  # no work billed (a refused or failed job)
    from coderai.gateway.errors import ApiError

    with pytest.raises(ApiError) as err:
        checked_work(cfg, img(width=4096, height=4096))
    assert err.value.status == 400 and err.value.param == "size"


def test_the_header_size_is_what_pillow_decodes():
    """The size the gateway prices an edit at is the one the engine's Pillow opens (baseline and progressive JPEG,
    with EXIF, and PNG)."""
    Image = pytest.importorskip("PIL.Image")
    import io

    for fmt, kw in (
        ("PNG", {}),
        ("JPEG", {}),
        ("JPEG", {"progressive": True}),
        ("JPEG", {"exif": b"Exif\x00\x00" + b"\x00" * 64}),
    ):
        buf = io.BytesIO()
        Image.new("RGB", (123, 77)).save(buf, fmt, **kw)
        assert image_size(buf.getvalue()) == Image.open(io.BytesIO(buf.getvalue())).size == (123, 77), (fmt, kw)
