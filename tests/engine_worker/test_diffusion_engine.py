"""The diffusers engines on tiny random pipelines built offline: real denoising, PNG and MP4 out, on the CPU."""

from __future__ import annotations

import io

import pytest

from coderai.contracts import ModelConfig
from coderai.contracts.media import Blob, ImageJob, VideoJob
from coderai.engine_worker.engines import BadInput, EngineLoadError, engine_class
from coderai.engine_worker.engines.base import CancelFlag
from coderai.tiny_models.diffusion import ensure_tiny_sd, ensure_tiny_t2v

pytest.importorskip("diffusers")
av = pytest.importorskip("av")
Image = pytest.importorskip("PIL.Image")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """`threads` is process-wide in torch: give it back afterwards. One thread, because on a shared 2-core box
    two threads' spinning barriers make these tiny models several times slower, not faster."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def images():
    e = engine_class("diffusers")(
        ModelConfig(
            name="sd",
            engine="diffusers",
            path=str(ensure_tiny_sd()),
            params={"threads": 1, "steps": 2, "max_pixels": 128 * 128},
        )
    )
    e.load()
    yield e
    e.close()


@pytest.fixture(scope="module")
def videos():
    e = engine_class("video")(
        ModelConfig(name="t2v", engine="video", path=str(ensure_tiny_t2v()), params={"threads": 1, "steps": 2})
    )
    e.load()
    yield e
    e.close()


class Progress:
    """A stand-in for the worker's emit: records the progress values an engine reports."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def __call__(self, progress: float) -> None:
        self.values.append(progress)


def job(**kw) -> ImageJob:
    return ImageJob(request_id="r", model="sd", **{"prompt": "a red fox in the snow", "width": 64, "height": 64, **kw})


def edit(picture: bytes, **kw) -> ImageJob:
    """An edit leaving width/height unset (the struct's defaults): the answer keeps the picture's size."""
    return ImageJob(request_id="r", model="sd", prompt="make it blue", image=Blob(data=picture), **kw)


def png(color: str = "orange", size: tuple[int, int] = (96, 72), mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


def decode(blob: Blob):
    assert blob.content_type == "image/png"
    img = Image.open(io.BytesIO(blob.data))
    assert img.format == "PNG"
    return img


def test_text_to_image_is_a_png_of_the_asked_size_with_progress(images):
    progress = Progress()
    result, usage = images.image(job(seed=11), CancelFlag(), progress)
    assert len(result.images) == 1 and result.seeds == [11]
    img = decode(result.images[0])
    assert img.size == (64, 64) and img.mode == "RGB"
    assert any(lo < hi for lo, hi in img.getextrema())  # denoised noise, not a blank picture
    assert progress.values == sorted(progress.values) and progress.values[-1] == 1.0 and len(progress.values) == 2
    assert usage.prompt_tokens > 2 and usage.total_tokens == usage.prompt_tokens


def test_n_images_get_consecutive_seeds_each_its_own_picture(images):
    result, usage = images.image(job(n=2, seed=40), CancelFlag(), None)
    assert result.seeds == [40, 41] and len(result.images) == 2
    first, second = (decode(b).tobytes() for b in result.images)
    assert first != second
    alone, single = images.image(job(seed=41), CancelFlag(), None)
    # a gateway may split n over workers with seed + i: each image must depend on its own seed only
    assert decode(alone.images[0]).tobytes() == second
    assert usage.prompt_tokens == 2 * single.prompt_tokens


def test_same_seed_gives_identical_bytes(images):
    a, _ = images.image(job(seed=7), CancelFlag(), None)
    b, _ = images.image(job(seed=7), CancelFlag(), None)
    assert a.images[0].data == b.images[0].data


def test_no_seed_draws_one_and_reports_it(images):
    result, _ = images.image(job(), CancelFlag(), None)
    assert len(result.seeds) == 1 and result.seeds[0] >= 0
    again, _ = images.image(job(seed=result.seeds[0]), CancelFlag(), None)
    assert again.images[0].data == result.images[0].data


def test_inpaint_edit_keeps_the_input_size(images):
    mask = Image.new("L", (96, 72), 0)
    mask.paste(255, (0, 0, 48, 72))  # repaint the left half
    buf = io.BytesIO()
    mask.save(buf, format="PNG")
    progress = Progress()
    result, _ = images.image(
        edit(png(), mask=Blob(data=buf.getvalue()), seed=3, strength=0.5, steps=4), CancelFlag(), progress
    )
    assert decode(result.images[0]).size == (96, 72)
    assert progress.values[-1] == 1.0 and len(progress.values) == 2  # strength 0.5 of 4 steps


def test_edit_without_mask_and_with_explicit_size(images):
    result, _ = images.image(edit(png(size=(100, 60)), seed=1), CancelFlag(), None)
    assert decode(result.images[0]).size == (96, 64)  # rounded to multiples of 8
    resized, _ = images.image(edit(png(), width=64, height=80, seed=1), CancelFlag(), None)
    assert decode(resized.images[0]).size == (64, 80)


def test_big_edit_input_is_shrunk_to_the_pixel_limit(images):
    result, _ = images.image(edit(png(size=(400, 200)), steps=1, strength=1.0), CancelFlag(), None)
    w, h = decode(result.images[0]).size
    assert w * h <= 128 * 128 and w % 8 == 0 and h % 8 == 0 and w > h


def test_transparent_mask_is_accepted(images):
    # OpenAI's edit masks mark the area to repaint by transparency
    result, _ = images.image(edit(png(), mask=Blob(data=png((0, 0, 0, 0), mode="RGBA")), seed=2), CancelFlag(), None)
    assert decode(result.images[0]).size == (96, 72)


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"image": Blob(data=b"definitely not a picture")}, "image"),
        ({"image": Blob(data=png()), "mask": Blob(data=b"\x89PNG broken")}, "mask"),
        ({"mask": Blob(data=png())}, "mask"),
        ({"width": 65}, "size"),
        ({"height": 56}, "size"),
        ({"width": 256, "height": 256}, "size"),  # over max_pixels
        ({"n": 0}, "n"),
        ({"steps": 0}, "steps"),
        ({"seed": -1}, "seed"),
        ({"image": Blob(data=png()), "strength": 1.5}, "strength"),
    ],
)
def test_bad_input_names_the_field(images, kw, param):
    with pytest.raises(BadInput) as err:
        images.image(job(**kw), CancelFlag(), None)
    assert err.value.param == param and str(err.value)


def test_cancelled_job_stops_before_any_image(images):
    flag = CancelFlag()
    flag.set()
    progress = Progress()
    result, usage = images.image(job(n=3, seed=1), flag, progress)
    assert result.images == [] and result.seeds == [] and progress.values == [] and usage.prompt_tokens == 0


class CancelAfterFirstStep(Progress):
    """The caller goes away while the first step is reported."""

    def __init__(self) -> None:
        super().__init__()
        self.flag = CancelFlag()

    def __call__(self, progress: float) -> None:
        super().__call__(progress)
        self.flag.set()


def test_cancel_between_steps_stops_the_job_and_the_engine_still_works(images):
    caller = CancelAfterFirstStep()
    result, _ = images.image(job(n=2, seed=1), caller.flag, caller)
    assert result.images == [] and caller.values == [0.25]  # step 2 of image 1 never ran
    after, _ = images.image(job(seed=1), CancelFlag(), None)
    assert decode(after.images[0]).size == (64, 64)


def test_missing_model_folder_fails_to_load(tmp_path):
    e = engine_class("diffusers")(ModelConfig(name="x", engine="diffusers", path=str(tmp_path / "nothing")))
    with pytest.raises(EngineLoadError):
        e.load()


def test_video_is_an_mp4_with_the_asked_frames_and_progress(videos):
    progress = Progress()
    vjob = VideoJob(
        request_id="r",
        model="t2v",
        prompt="waves on a beach",
        num_frames=5,
        width=80,
        height=64,
        fps=6,
        seed=9,
        steps=3,
    )
    result, usage = videos.video(vjob, CancelFlag(), progress)
    assert result.video.content_type == "video/mp4" and result.video.data[4:8] == b"ftyp"
    assert (result.frames, result.width, result.height, result.fps, result.seed) == (5, 80, 64, 6, 9)
    with av.open(io.BytesIO(result.video.data)) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == 6
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    assert len(frames) == 5
    assert all(f.shape == (64, 80, 3) for f in frames)
    assert progress.values == sorted(progress.values) and len(progress.values) == 3 and progress.values[-1] == 1.0
    assert usage.prompt_tokens > 2


def test_video_cancel_between_steps_returns_no_video(videos):
    caller = CancelAfterFirstStep()
    vjob = VideoJob(request_id="r", model="t2v", prompt="x", num_frames=2, width=64, height=64, steps=3)
    result, _ = videos.video(vjob, caller.flag, caller)
    assert result.video.data == b"" and result.frames == 0 and caller.values == [pytest.approx(1 / 3)]


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"width": 100}, "size"),
        ({"num_frames": 0}, "num_frames"),
        ({"fps": 0}, "fps"),
    ],
)
def test_video_bad_input_names_the_field(videos, kw, param):
    with pytest.raises(BadInput) as err:
        videos.video(
            VideoJob(request_id="r", model="t2v", prompt="x", **{"width": 64, "height": 64, **kw}), CancelFlag(), None
        )
    assert err.value.param == param
