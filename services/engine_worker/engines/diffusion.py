"""Diffusers: text-to-image and image edits (`ImageEngine`), text-to-video (`VideoEngine`).

`ImageEngine` loads any text-to-image pipeline diffusers' AutoPipeline knows (Stable Diffusion 1.x/2.x, SDXL, ...)
and derives the edit pipelines from the same weights on first use: image-to-image for an edit without a mask,
inpainting with one (a plain 4-channel UNet inpaints by re-noising the kept area each step). `VideoEngine` runs a
`TextToVideoSDPipeline` and encodes MP4 with PyAV's bundled FFmpeg (codec `mpeg4`: h264 may be missing there).

Model params: `threads` (torch CPU threads; process-wide), `device` (default cuda when present), `dtype` (default
float16 on cuda, float32 on cpu), `steps` (default 20), `guidance_scale`, and the limits the gateway also checks
(`coderai/media_work.py`): `max_pixels` (default 1024*1024), `max_steps` (default 150), `max_n` (images, default
10), `max_frames` (video, default 64), `stages` (video: relay the generation stage by stage over several nodes, each
loading only its part; see `video_stages.py` and docs/video-stages.md). A job's `n` images are made one after
another with seeds `seed`, `seed + 1`, ..., so each image depends on its own seed alone and a gateway splitting
`n` over workers gets the same pictures.
An edit that gives no width/height keeps the picture's own size (shrunk to `max_pixels`).
Cancellation is checked every denoising step and stops the job before the VAE decodes; nobody reads what returns.
"""

from __future__ import annotations

import io
import math
import os
import secrets
from collections.abc import Callable
from typing import Any

import msgspec

from coderai.contracts import ModelConfig, Usage
from coderai.contracts.media import Blob, ImageJob, ImageResult, VideoJob, VideoResult
from coderai.engine_worker.engines.base import BadInput, CancelFlag, Engine, EngineLoadError, torch_device
from coderai.media_work import DEFAULT_SIDE, limits

Emit = Callable[..., None]
"""emit(progress=0..1)"""

DEFAULT_STRENGTH = 0.8
MIN_SIDE = 64
MAX_SEED = 2**63 - 1
# ImageJob's own width/height defaults (0, "not given"): an edit that leaves both keeps the input picture's size
UNSET_SIZE = tuple(f.default for f in msgspec.structs.fields(ImageJob) if f.name in ("width", "height"))


class _Cancelled(Exception):
    """Raised from a step callback: leaves the pipeline at once, skipping the remaining steps and the VAE."""


class _DiffusionEngine(Engine):
    """Loading, limits and seeds shared by the image and video engines."""

    default_guidance = 7.5

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.pipe: Any = None
        params = config.params
        lim = limits(params)  # the gateway checks jobs against the same limits before they get here
        self.max_pixels, self.default_steps, self.max_steps, self.max_frames = (
            lim.max_pixels,
            lim.default_steps,
            lim.max_steps,
            lim.max_frames,
        )
        self.guidance = config.param_float("guidance_scale", self.default_guidance)

    def _pipeline_class(self) -> Any:
        raise NotImplementedError

    def load(self) -> None:
        try:
            import diffusers  # noqa: F401  -- imported to fail here, with the install hint, not inside _pipeline_class
            import torch  # noqa: F401  -- likewise: imported to fail here, with the install hint
        except ImportError as exc:
            raise EngineLoadError("diffusers is not installed: pip install 'coderai[diffusers]'") from exc
        path, device, dtype = self._placement()
        try:
            pipe = self._pipeline_class().from_pretrained(path, local_files_only=True, dtype=dtype)
            self.pipe = pipe.to(device)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise EngineLoadError(f"diffusers could not load {path}: {exc}") from exc
        self.pipe.set_progress_bar_config(disable=True)

    def _placement(self) -> tuple[str, str, Any]:
        """(model folder, device, torch dtype) from the config; sets torch's CPU threads when asked."""
        import torch

        path = os.path.expanduser(self.config.path)
        if not os.path.isdir(path):
            raise EngineLoadError(f"diffusers model folder not found: {path}")
        cfg = self.config
        if threads := cfg.param_int("threads"):
            torch.set_num_threads(threads)
        device = torch_device(cfg, cfg.param_str("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype_name = cfg.param_str("dtype") or ("float16" if device.startswith("cuda") else "float32")
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise EngineLoadError(f"unknown dtype {dtype_name!r} in the model's params (float32, float16, bfloat16)")
        return path, device, dtype

    def close(self) -> None:
        on_gpu = self.pipe is not None and self.pipe.device.type == "cuda"
        self.pipe = None
        if on_gpu:  # give the freed memory back to the driver, for the next model placed on this card
            import torch

            torch.cuda.empty_cache()

    def _size(self, width: int, height: int) -> tuple[int, int]:
        if width % 8 or height % 8:
            raise BadInput(f"width and height must be multiples of 8, got {width}x{height}", param="size")
        if width < MIN_SIDE or height < MIN_SIDE:
            raise BadInput(f"width and height must be at least {MIN_SIDE}, got {width}x{height}", param="size")
        if width * height > self.max_pixels:
            raise BadInput(f"{width}x{height} is more than this model's {self.max_pixels} pixels", param="size")
        return width, height

    def _steps(self, steps: int | None) -> int:
        steps = self.default_steps if steps is None else steps
        if not 1 <= steps <= self.max_steps:
            raise BadInput(f"steps must be between 1 and {self.max_steps}, got {steps}", param="steps")
        return steps

    def _seeds(self, seed: int | None, count: int) -> list[int]:
        if seed is None:
            seed = secrets.randbelow(2**31)
        if not 0 <= seed <= MAX_SEED - count:
            raise BadInput(f"seed must be between 0 and {MAX_SEED - count}, got {seed}", param="seed")
        return [seed + i for i in range(count)]

    def _usage(self, prompt: str, times: int) -> Usage:
        """The prompt's CLIP tokens (what the text encoder read), once per image or video made."""
        tok = getattr(self.pipe, "tokenizer", None)
        if tok is None:
            return Usage()
        used = len(tok(prompt, truncation=True, max_length=tok.model_max_length).input_ids) * times
        return Usage(prompt_tokens=used, total_tokens=used)


def _generator(seed: int) -> Any:
    import torch

    # CPU generators on every device: the same seed draws the same noise on a GPU box and a laptop
    return torch.Generator("cpu").manual_seed(seed)


def _open_image(data: bytes, param: str) -> Any:
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise BadInput(f"{param} is not a readable PNG, JPEG or WebP picture ({exc})", param=param) from exc
    return img


def _mask(data: bytes, size: tuple[int, int]) -> Any:
    """White (or, in OpenAI's convention, transparent) areas are repainted; the rest is kept."""
    from PIL import ImageOps

    img = _open_image(data, "mask")
    if "A" in img.getbands() and img.getchannel("A").getextrema()[0] < 255:
        mask = ImageOps.invert(img.getchannel("A"))
    else:
        mask = img.convert("L")
    return mask.resize(size) if mask.size != size else mask


def _edit_size(img_size: tuple[int, int], max_pixels: int) -> tuple[int, int]:
    """The picture's own size, shrunk to fit `max_pixels` and rounded to multiples of 8."""
    w, h = img_size
    scale = min(1.0, math.sqrt(max_pixels / (w * h)))
    return max(MIN_SIDE, int(w * scale) // 8 * 8), max(MIN_SIDE, int(h * scale) // 8 * 8)


def _png(img: Any) -> Blob:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return Blob(data=buf.getvalue(), size=buf.tell(), content_type="image/png")


class ImageEngine(_DiffusionEngine):
    """Text-to-image and edits (`image`, optional `mask`) with a diffusers text-to-image model."""

    family = "diffusers"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self._edit_pipes: dict[str, Any] = {}

    def _pipeline_class(self) -> Any:
        from diffusers.pipelines.auto_pipeline import AutoPipelineForText2Image

        return AutoPipelineForText2Image

    def close(self) -> None:
        self._edit_pipes.clear()
        super().close()

    def _edit_pipe(self, kind: str) -> Any:
        """The img2img or inpainting pipeline over the loaded weights (no second copy in memory)."""
        if kind not in self._edit_pipes:
            from diffusers.pipelines.auto_pipeline import AutoPipelineForImage2Image, AutoPipelineForInpainting

            auto = AutoPipelineForInpainting if kind == "inpaint" else AutoPipelineForImage2Image
            try:
                pipe = auto.from_pipe(self.pipe)
            except ValueError as exc:
                what = "inpaint (edit with a mask)" if kind == "inpaint" else "edit images"
                raise BadInput(f"this model cannot {what}", param="mask" if kind == "inpaint" else "image") from exc
            pipe.set_progress_bar_config(disable=True)
            self._edit_pipes[kind] = pipe
        return self._edit_pipes[kind]

    def image(self, job: ImageJob, cancel: CancelFlag, emit: Emit | None) -> tuple[ImageResult, Usage]:
        if job.n < 1:
            raise BadInput(f"n must be at least 1, got {job.n}", param="n")
        steps = self._steps(job.steps)
        seeds = self._seeds(job.seed, job.n)
        pipe, kwargs = self._prepare(job)
        if "strength" in kwargs:  # edits run int(steps * strength) steps: at least one
            steps = max(steps, math.ceil(1 / kwargs["strength"]))
        kwargs.update(
            prompt=job.prompt,
            num_inference_steps=steps,
            guidance_scale=self.guidance if job.guidance_scale is None else job.guidance_scale,
        )
        if job.negative_prompt:
            kwargs["negative_prompt"] = job.negative_prompt
        images: list[Blob] = []
        for k, seed in enumerate(seeds):
            if cancel:
                break

            def on_step(p: Any, i: int, _t: Any, tensors: dict, k: int = k) -> dict:
                if cancel:
                    raise _Cancelled
                if emit is not None:
                    emit(progress=(k + (i + 1) / max(1, p.num_timesteps)) / len(seeds))
                return tensors

            try:
                out = pipe(generator=_generator(seed), callback_on_step_end=on_step, **kwargs)
            except _Cancelled:
                break
            images.append(_png(out.images[0]))
        return ImageResult(images=images, seeds=seeds[: len(images)]), self._usage(job.prompt, len(images))

    def _prepare(self, job: ImageJob) -> tuple[Any, dict[str, Any]]:
        """The pipeline for the job and its size/image arguments, every input checked."""
        if job.image is None:
            if job.mask is not None:
                raise BadInput("a mask needs an image to edit", param="mask")
            width, height = self._size(job.width or DEFAULT_SIDE, job.height or DEFAULT_SIDE)
            return self.pipe, {"width": width, "height": height}
        strength = DEFAULT_STRENGTH if job.strength is None else job.strength
        if not 0.01 <= strength <= 1:
            raise BadInput(f"strength must be between 0.01 and 1, got {strength}", param="strength")
        picture = _open_image(job.image.data, "image").convert("RGB")
        if (job.width, job.height) == UNSET_SIZE:
            size = self._size(*_edit_size(picture.size, self.max_pixels))
        else:
            size = self._size(job.width, job.height)
        if picture.size != size:
            from PIL import Image

            picture = picture.resize(size, Image.Resampling.LANCZOS)
        kwargs: dict[str, Any] = {"image": picture, "strength": strength}
        if job.mask is None:
            return self._edit_pipe("img2img"), kwargs
        kwargs.update(mask_image=_mask(job.mask.data, size), width=size[0], height=size[1])
        return self._edit_pipe("inpaint"), kwargs


class VideoEngine(_DiffusionEngine):
    """Text-to-video with a `TextToVideoSDPipeline` model (ModelScope-style), as MP4."""

    family = "video"
    default_guidance = 9.0  # TextToVideoSDPipeline's own default

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.staged: Any = None  # the parts, loaded stage by stage, of a stage-relay model

    def _pipeline_class(self) -> Any:
        from diffusers.pipelines.deprecated.text_to_video_synthesis.pipeline_text_to_video_synth import (
            TextToVideoSDPipeline,
        )

        return TextToVideoSDPipeline

    def load(self) -> None:
        """A stage-relay model (`params.stages`) loads no part yet: each stage loads the part it needs
        (text encoder, UNet, VAE) on first use, so a node holds only what the stages it runs need."""
        if not self.config.params.get("stages"):
            super().load()
            return
        from coderai.engine_worker.engines.video_stages import StagedVideo

        try:
            import diffusers  # noqa: F401  -- imported to fail here, with the install hint
        except ImportError as exc:
            raise EngineLoadError("diffusers is not installed: pip install 'coderai[diffusers]'") from exc
        path, device, dtype = self._placement()
        try:
            self.staged = StagedVideo(path, device, dtype)
        except (OSError, KeyError, ValueError) as exc:
            raise EngineLoadError(f"{path} is not a text-to-video model folder: {exc}") from exc

    def close(self) -> None:
        if self.staged is not None:
            self.staged.close()
            self.staged = None
        super().close()

    def _check(self, job: VideoJob) -> tuple[int, int, int]:
        """(width, height, steps) of a job whose every setting is checked against this model's limits."""
        width, height = self._size(job.width, job.height)
        if not 1 <= job.num_frames <= self.max_frames:
            raise BadInput(
                f"num_frames must be between 1 and {self.max_frames}, got {job.num_frames}", param="num_frames"
            )
        if not 1 <= job.fps <= 120:
            raise BadInput(f"fps must be between 1 and 120, got {job.fps}", param="fps")
        return width, height, self._steps(job.steps)

    def stage(self, job: Any, inputs: dict[str, Any], cancel: CancelFlag, on_step: Callable[[int], None]) -> Any:
        """One stage of a relayed video (`video_stages.run_stage`); decode's frames come back as MP4 bytes."""
        from coderai.engine_worker.engines.video_stages import run_stage

        if self.staged is None:
            raise BadInput(f"model {self.config.name} is not set up for stage relay (params.stages)", param="model")
        self._check(job.job)
        if job.job.seed is None or not 0 <= job.job.seed <= MAX_SEED:
            raise BadInput("a relayed video needs its seed fixed by the caller", param="seed")
        out = run_stage(self.staged, job, inputs, self.guidance, job.job.seed, cancel, on_step)
        if out.frames is not None:
            out.frames = _mp4(out.frames, job.job.fps)
        return out

    def video(self, job: VideoJob, cancel: CancelFlag, emit: Emit | None) -> tuple[VideoResult, Usage]:
        width, height, steps = self._check(job)
        pipe = self.pipe
        if pipe is None:  # a stage-relay model asked for a whole video: load all of it now
            super().load()
            pipe = self.pipe
        seed = self._seeds(job.seed, 1)[0]
        reported = 0.0

        # this pipeline only has the legacy per-step callback: (step index, timestep, latents)
        def on_step(i: int, _t: Any, _latents: Any) -> None:
            nonlocal reported
            if cancel:
                raise _Cancelled
            reported = min(1.0, (i + 1) / steps)
            if emit is not None:
                emit(progress=reported)

        try:
            out = pipe(
                prompt=job.prompt,
                negative_prompt=job.negative_prompt or None,
                num_frames=job.num_frames,
                width=width,
                height=height,
                num_inference_steps=steps,
                guidance_scale=self.guidance,
                generator=_generator(seed),
                output_type="np",
                callback=on_step,
                callback_steps=1,
            )
        except _Cancelled:
            return VideoResult(video=Blob(), frames=0, width=width, height=height, fps=job.fps, seed=seed), Usage()
        if emit is not None and reported < 1.0:  # a multi-order scheduler may stop its callbacks short of the end
            emit(progress=1.0)
        data = _mp4(out.frames[0], job.fps)
        video = Blob(data=data, size=len(data), content_type="video/mp4")
        result = VideoResult(video=video, frames=len(out.frames[0]), width=width, height=height, fps=job.fps, seed=seed)
        return result, self._usage(job.prompt, 1)


def _mp4(frames: Any, fps: int) -> bytes:
    """Frames (num, height, width, 3) of floats in 0..1 as an MPEG-4 Part 2 video in an MP4 file."""
    import av
    import numpy as np

    pixels = (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)
    height, width = pixels.shape[1:3]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        # FFmpeg's mpeg4 default (200 kb/s) smears anything bigger than a thumbnail; ~0.5 bit per pixel is clean
        stream.bit_rate = max(400_000, width * height * fps // 2)
        for frame in pixels:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()
