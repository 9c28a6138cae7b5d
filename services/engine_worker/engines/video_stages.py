"""A text-to-video pipeline run stage by stage: encode, denoise steps a..b, decode, each on whatever node runs it.

`TextToVideoSDPipeline.__call__` does, in order: encode the prompt (and the negative one, for guidance), set the
scheduler's timesteps, draw the initial latents from the seed's CPU generator, run the UNet over every timestep
with classifier-free guidance and one scheduler step each, and decode the latents with the VAE. `StagedVideo`
does the same arithmetic in the same order, but cut into stages, and it loads only the part a stage needs (the
text encoder, the UNet, the VAE), so a node that could never hold the whole model can still run its stage.
Between stages everything lives in tensors (latents, prompt embeddings, the generator's state): the same seed
gives the same frames as one `pipe(...)` call (checked to be bit-identical on CPU, float32, DDIM).

A denoise may stop after any step and go on elsewhere only with a scheduler whose step depends on nothing but
the timesteps, the step index, the latents and the generator (`RESUMABLE`); others run their whole denoise in one
stage. Runs in the engine's thread; no I/O beyond reading the model folder.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from coderai.contracts.stages import (
    DTYPES,
    Handoff,
    HandoffMismatch,
    SchedulerState,
    StageJob,
    TensorRef,
)
from coderai.contracts.stages import RESUMABLE_SCHEDULERS as RESUMABLE

ETA = 0.0  # TextToVideoSDPipeline's default; what the single-node run uses too


@dataclass
class Tensor:
    """A tensor as it travels between nodes: raw C-order bytes with shape, dtype and checksum."""

    data: bytes
    shape: list[int]
    dtype: str
    sha256: str


def pack_tensor(t: Any) -> Tensor:
    """Any torch tensor as bytes (viewed as uint8, so bfloat16 travels as well as float32)."""
    import torch

    t = t.detach().to("cpu").contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise HandoffMismatch(f"cannot hand off a {dtype} tensor")
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return Tensor(data=data, shape=list(t.shape), dtype=dtype, sha256=hashlib.sha256(data).hexdigest())


def unpack_tensor(name: str, data: bytes, shape: list[int], dtype: str, sha256: str) -> Any:
    """The tensor back from its bytes; a checksum or size that does not match is a HandoffMismatch."""
    import torch

    if hashlib.sha256(data).hexdigest() != sha256:
        raise HandoffMismatch(f"tensor {name!r} does not match its checksum (corrupted or replaced)")
    tdtype = getattr(torch, dtype, None)
    if dtype not in DTYPES or not isinstance(tdtype, torch.dtype):
        raise HandoffMismatch(f"tensor {name!r} has unknown dtype {dtype!r}")
    count = 1
    for d in shape:
        count *= d
    if len(data) != count * tdtype.itemsize:
        raise HandoffMismatch(
            f"tensor {name!r} has {len(data)} bytes, shape {shape} of {dtype} needs {count * tdtype.itemsize}"
        )
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(tdtype).reshape(shape)


def read_parts(path: str) -> tuple[str, int, int]:
    """(scheduler class, UNet input channels, VAE scale factor) from the model folder's configs."""

    def cfg(sub: str, name: str) -> dict[str, Any]:
        with open(os.path.join(path, sub, name), encoding="utf-8") as fh:
            return json.load(fh)

    sched = cfg("scheduler", "scheduler_config.json")["_class_name"]
    channels = int(cfg("unet", "config.json")["in_channels"])
    scale = 2 ** (len(cfg("vae", "config.json")["block_out_channels"]) - 1)
    return sched, channels, scale


class StagedVideo:
    """The parts of one text-to-video model folder, each loaded on the first stage that needs it."""

    def __init__(self, path: str, device: str, dtype: Any) -> None:
        self.path, self.device, self.dtype = path, device, dtype
        self.scheduler_name, self.channels, self.scale = read_parts(path)
        self._parts: dict[str, Any] = {}

    def _part(self, kind: str) -> Any:
        """A pipeline holding only what `kind` needs (diffusers skips a component given as None)."""
        if kind not in self._parts:
            from diffusers.pipelines.deprecated.text_to_video_synthesis.pipeline_text_to_video_synth import (
                TextToVideoSDPipeline,
            )

            skip = {
                "encode": ("unet", "vae"),
                "denoise": ("text_encoder", "tokenizer", "vae"),
                "decode": ("text_encoder", "tokenizer", "unet"),
            }[kind]
            pipe = TextToVideoSDPipeline.from_pretrained(
                self.path, local_files_only=True, dtype=self.dtype, **{k: None for k in skip}
            )
            pipe.set_progress_bar_config(disable=True)
            self._parts[kind] = pipe.to(self.device)
        return self._parts[kind]

    def loaded(self) -> list[str]:
        return sorted(self._parts)

    def close(self) -> None:
        self._parts.clear()

    def _scheduler(self, steps: int) -> tuple[Any, list[float]]:
        """A fresh scheduler set to `steps` timesteps; its config comes with whichever part is loaded."""
        pipe = next(iter(self._parts.values()))
        sched = pipe.scheduler.__class__.from_config(pipe.scheduler.config)
        sched.set_timesteps(steps, device=self.device)
        return sched, [float(t) for t in sched.timesteps]

    def encode(
        self,
        prompt: str,
        negative: str | None,
        guidance: float,
        seed: int,
        num_frames: int,
        width: int,
        height: int,
        steps: int,
    ) -> tuple[dict[str, Any], SchedulerState, int]:
        """Prompt embeddings (negative first when guided), the seed's initial latents, the generator after
        drawing them; the scheduler's state at step 0; the prompt's token count."""
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        pipe = self._part("encode")
        guided = guidance > 1.0
        with torch.no_grad():
            pos, neg = pipe.encode_prompt(prompt, self.device, 1, guided, negative or None)
        embeds = torch.cat([neg, pos]) if guided else pos
        sched, timesteps = self._scheduler(steps)
        gen = torch.Generator("cpu").manual_seed(seed)
        shape = (1, self.channels, num_frames, height // self.scale, width // self.scale)
        latents = randn_tensor(shape, generator=gen, device=torch.device(self.device), dtype=embeds.dtype)
        latents = latents * sched.init_noise_sigma
        tok = pipe.tokenizer
        tokens = len(tok(prompt, truncation=True, max_length=tok.model_max_length).input_ids)
        state = SchedulerState(name=type(sched).__name__, steps=steps, timesteps=timesteps, step_index=0)
        return {"prompt_embeds": embeds, "latents": latents, "generator": gen.get_state()}, state, tokens

    def denoise(
        self,
        tensors: dict[str, Any],
        state: SchedulerState,
        guidance: float,
        start: int,
        end: int,
        on_step: Callable[[int], None],
    ) -> tuple[dict[str, Any], SchedulerState]:
        """Steps `start` .. `end` (exclusive) of the schedule in `state`; `on_step(i)` after each (it may raise
        to stop). The latents and generator go on; the prompt embeddings are handed on unchanged."""
        import torch

        pipe = self._part("denoise")
        sched, timesteps = self._scheduler(state.steps)
        if type(sched).__name__ != state.name:
            raise HandoffMismatch(
                f"the handoff was made with {state.name}; this node's model uses {type(sched).__name__}"
            )
        if timesteps != state.timesteps:
            raise HandoffMismatch("the handoff's timesteps differ from this node's schedule for the same steps")
        if start > 0 and state.name not in RESUMABLE:
            raise HandoffMismatch(f"{state.name} keeps state between steps: its denoise cannot resume at step {start}")
        latents = tensors["latents"].to(self.device, self.dtype)
        embeds = tensors["prompt_embeds"].to(self.device, self.dtype)
        if latents.shape[1] != self.channels:
            raise HandoffMismatch(f"latents have {latents.shape[1]} channels, this UNet takes {self.channels}")
        gen = torch.Generator("cpu")
        gen.set_state(tensors["generator"])
        extra = pipe.prepare_extra_step_kwargs(gen, ETA)
        guided = guidance > 1.0
        with torch.no_grad():
            for i in range(start, end):
                t = sched.timesteps[i]
                x = torch.cat([latents] * 2) if guided else latents
                x = sched.scale_model_input(x, t)
                noise = pipe.unet(x, t, encoder_hidden_states=embeds, return_dict=False)[0]
                if guided:
                    uncond, text = noise.chunk(2)
                    noise = uncond + guidance * (text - uncond)
                # the same reshapes as the pipeline: the scheduler steps a batch of frames
                b, ch, f, w, h = latents.shape
                flat = latents.permute(0, 2, 1, 3, 4).reshape(b * f, ch, w, h)
                noise = noise.permute(0, 2, 1, 3, 4).reshape(b * f, ch, w, h)
                flat = sched.step(noise, t, flat, **extra).prev_sample
                latents = flat[None, :].reshape(b, f, ch, w, h).permute(0, 2, 1, 3, 4)
                on_step(i)
        out = {"prompt_embeds": tensors["prompt_embeds"], "latents": latents, "generator": gen.get_state()}
        return out, SchedulerState(name=state.name, steps=state.steps, timesteps=state.timesteps, step_index=end)

    def decode(self, latents: Any, width: int, height: int) -> Any:
        """Frames (num, height, width, 3) as floats in 0..1, from the final latents."""
        import torch

        pipe = self._part("decode")
        if latents.shape[3] * self.scale != height or latents.shape[4] * self.scale != width:
            raise HandoffMismatch(f"latents {list(latents.shape)} do not decode to {width}x{height} with this VAE")
        with torch.no_grad():
            video = pipe.decode_latents(latents.to(self.device, self.dtype))
        return pipe.video_processor.postprocess_video(video=video, output_type="np")[0]


@dataclass
class StageOutput:
    """What a stage made: tensors for the next stage and the scheduler's state, or (decode) the frames."""

    tensors: dict[str, Tensor]
    scheduler: SchedulerState
    seed: int
    guidance: float
    frames: Any = None
    tokens: int = 0


def run_stage(
    staged: StagedVideo,
    job: StageJob,
    inputs: dict[str, Tensor],
    guidance: float,
    seed: int,
    cancel: Any,
    on_step: Callable[[int], None],
) -> StageOutput:
    """One stage of `job` from the handoff's tensors `inputs` (already fetched, not yet checked against their
    checksums). The handoff itself was checked by the caller (`check_handoff`)."""
    v, stage = job.job, job.stage
    loaded = {name: unpack_tensor(name, t.data, t.shape, t.dtype, t.sha256) for name, t in inputs.items()}
    if stage.kind == "encode":
        tensors, state, tokens = staged.encode(
            v.prompt, v.negative_prompt, guidance, seed, v.num_frames, v.width, v.height, job.steps
        )
        return StageOutput({k: pack_tensor(t) for k, t in tensors.items()}, state, seed, guidance, tokens=tokens)
    assert job.handoff is not None  # check_handoff made sure
    if job.handoff.guidance != guidance:
        raise HandoffMismatch(f"the handoff was guided at {job.handoff.guidance}, this node's model at {guidance}")
    state = job.handoff.scheduler
    if stage.kind == "denoise":

        def step(i: int) -> None:
            if cancel:
                raise StageCancelled
            on_step(i)

        tensors, state = staged.denoise(loaded, state, guidance, stage.start, stage.end, step)
        return StageOutput({k: pack_tensor(t) for k, t in tensors.items()}, state, seed, guidance)
    frames = staged.decode(loaded["latents"], v.width, v.height)
    return StageOutput({}, state, seed, guidance, frames=frames)


class StageCancelled(Exception):
    """Raised from a step: the caller went away, the stage stops between two steps."""


def make_handoff(job: StageJob, out: StageOutput, node: str, objects: dict[str, str]) -> Handoff:
    """The handoff a finished stage leaves: `objects` names where each of `out.tensors` was stored."""
    v = job.job
    refs = {
        k: TensorRef(object=objects[k], shape=t.shape, dtype=t.dtype, sha256=t.sha256) for k, t in out.tensors.items()
    }
    return Handoff(
        job_id=job.request_id,
        model=v.model,
        produced_by=job.stage.kind,
        node=node,
        tensors=refs,
        seed=out.seed,
        guidance=out.guidance,
        width=v.width,
        height=v.height,
        num_frames=v.num_frames,
        fps=v.fps,
        scheduler=out.scheduler,
    )
