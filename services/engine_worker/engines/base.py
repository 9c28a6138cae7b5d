"""What the worker needs from an engine: load, serve jobs into a FrameWriter, unload."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from coderai.contracts import ChatJob, CompletionJob, ModelConfig

if TYPE_CHECKING:
    import torch


class EngineLoadError(Exception):
    """The model could not be loaded (missing file, bad format, library absent)."""


class EngineLost(RuntimeError):
    """The engine lost its devices mid-job (a split model's RPC server went away): the job may succeed
    elsewhere, so the worker answers it retryable (`no_engine`), never as the engine's own failure."""


MEDIA_PARTS = {"image_url": "images", "input_audio": "audio", "file": "files"}


def refuse_media(messages: list[dict], model: str, takes: frozenset[str] = frozenset()) -> None:
    """BadInput (a 400 naming the part) for a content part this model cannot read: `takes` is the part types it
    can (`image_url` where it has a projector)."""
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS and kind not in takes:
                raise BadInput(
                    f"model '{model}' does not take {MEDIA_PARTS[kind]} (messages[{i}].content[{j}] is "
                    f"{kind}); a GGUF model reads images only with a projector (`mmproj` in its entry)",
                    f"messages[{i}].content[{j}]",
                )


class BadInput(ValueError):
    """The job's input cannot be used (unreadable audio, not an image, a size the model cannot make). The
    worker answers `bad_request` naming `param`, which the gateway turns into a 400; never a 5xx."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def one_prompt(engine: Engine, job: CompletionJob) -> str:
    """The prompt of a completion job for an engine without `prompt_lists` (the worker refuses a list before it runs,
    as `unhonoured` says; this is that refusal again where the engine reads it)."""
    if isinstance(job.prompt, list):
        family = engine.family or type(engine).__name__
        raise BadInput(f"model '{engine.config.name}' ({family}) takes one prompt per request", "prompt")
    return job.prompt


def to_device(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model.to(device)` for a transformers model, seen as the nn.Module it is: transformers wraps its `to` with
    functools.wraps, which a type checker cannot bind as a method."""
    return model.to(device)


def unhonoured(engine: Engine, job: ChatJob | CompletionJob) -> BadInput | None:
    """What of a chat or completion job `engine` cannot honour, as the 400 to answer; None if it can do it all."""
    name, family = engine.config.name, engine.family or type(engine).__name__
    params = job.params
    if params.n > 1 and job.stream and not engine.streams_choices:
        return BadInput(
            f"model '{name}' ({family}) streams one choice: send n > 1 without stream, or one request per choice", "n"
        )
    if isinstance(getattr(job, "prompt", None), list) and not engine.prompt_lists:
        return BadInput(f"model '{name}' ({family}) takes one prompt per request", "prompt")
    prompt = getattr(job, "prompt", None)
    if (
        params.n > 1
        and not engine.empty_prompt_choices
        and (prompt == "" or (isinstance(prompt, list) and "" in prompt))
    ):
        return BadInput(
            f"model '{name}' ({family}) cannot answer an empty prompt with n > 1: send it with n = 1", "prompt"
        )
    if params.logit_bias and not engine.logit_bias:
        return BadInput(f"model '{name}' ({family}) does not apply logit_bias", "logit_bias")
    takes = engine.media_takes()
    if takes is not None and (messages := getattr(job, "messages", None)):
        try:  # before the job queues for a slot: an image for a text-only model is refused at once
            refuse_media(messages, name, takes)
        except BadInput as exc:
            return exc
    return None


class Engine:
    """One loaded model. Subclasses implement `load`, the ops they serve, and `close`.

    An op is a method named after it, called in the engine's thread as `op(job, cancel, emit)`:
    - `chat`, `complete` return `(choices, usage)`; `emit(delta, text, finish_reason)` is given when streaming.
    - every other op (`embed`, `rerank`, `image`, `speech`, `transcribe`, `diarize`, `ocr`, `video`) returns
      `(output, usage)` with the op's result struct from `coderai.contracts.media`, its blobs inline (the worker
      moves big ones to the object store); `emit(data=bytes)` streams speech, `emit(progress=0..1)` reports
      progress. Input blobs arrive inline. Bad input raises `BadInput(message, param)`.
    """

    family = ""
    blocking = True  # False: the engine's calls return at once (no compute, no I/O) and run on the event loop
    max_concurrency = 1  # jobs run at once, each in its own thread; 1 for engines that are not thread-safe
    # what of a chat or completion job it honours; the worker refuses the rest with a 400 before running it
    streams_choices = False  # `n > 1` streamed (its emit names each delta's choice `index`)
    prompt_lists = False  # a completion job's `prompt` as a list of prompts
    logit_bias = False
    empty_prompt_choices = True  # an empty completion prompt with n > 1 (llama-server never ends that request)

    def media_takes(self) -> frozenset[str] | None:
        """The chat content parts beyond text it reads (`image_url`, `input_audio`, `file`); the worker refuses the
        others before the job waits for a slot. None: it does not say (it refuses what it cannot read itself)."""
        return None

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        # set by the worker: an engine whose devices went away (a split model's RPC server) calls it, from any
        # thread, with the reason; the worker stops sending it jobs and reports it failed
        self.on_lost: Callable[[str], None] | None = None
        self.on_back: Callable[[], None] | None = None  # ... and this once it serves again by itself
        self.warning = ""  # something an operator should know about how it runs (shown with the engine)

    def load(self) -> None:
        """Blocking: called in a thread."""
        raise NotImplementedError

    def close(self) -> None:
        """Free the model's memory."""

    def stats(self) -> dict[str, Any]:
        """Cache counters for the heartbeat: prompt_tokens, cached_tokens, prefix_hits, cache_bytes."""
        return {}


def visible_devices(config: ModelConfig) -> dict[str, str]:
    """The environment that pins a child server to the GPUs the scheduler gave this copy (`devices`): CUDA then
    numbers them 0.. among themselves, counted in PCI bus order as the heartbeat's NVML does; ggml's Vulkan backend
    likewise, in the order the heartbeat listed them (which also shows it a CPU-type device such as lavapipe,
    hidden unless named); {} for none."""
    if not config.devices:
        return {}
    ids = ",".join(str(i) for i in config.devices)
    return {"CUDA_VISIBLE_DEVICES": ids, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "GGML_VK_VISIBLE_DEVICES": ids}


def torch_device(config: ModelConfig, default: str) -> str:
    """The device an in-process engine loads on: the first GPU the scheduler gave this copy, else `default` (the
    engine's `device` param or its own choice); the worker counts GPUs in PCI bus order, as placement does."""
    return f"cuda:{config.devices[0]}" if config.devices else default


class CancelFlag:
    """A per-request flag the engine checks between tokens; `on_set` hooks cut a blocking wait short (a thread
    blocked reading a silent server's socket never gets to check the flag)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []

    def set(self) -> None:
        with self._lock:
            self._event.set()
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            with contextlib.suppress(Exception):  # a hook unblocks a reader; one that fails leaves the flag set
                hook()

    def on_set(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Run `hook` when the flag is set (at once if it is set already); returns the call that removes it."""
        with self._lock:
            if not self._event.is_set():
                self._hooks.append(hook)
                return lambda: self._remove(hook)
        hook()
        return lambda: None

    def _remove(self, hook: Callable[[], None]) -> None:
        with self._lock:
            if hook in self._hooks:
                self._hooks.remove(hook)

    def __bool__(self) -> bool:
        return self._event.is_set()
