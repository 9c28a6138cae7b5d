"""What the worker needs from an engine: load, serve jobs into a FrameWriter, unload."""

from __future__ import annotations

import threading

from coderai.contracts import ModelConfig


class EngineLoadError(Exception):
    """The model could not be loaded (missing file, bad format, library absent)."""


class Engine:
    """One loaded model. Subclasses implement `load`, the ops they serve, and `close`."""

    family = ""
    blocking = True  # False: the engine's calls return at once (no compute, no I/O) and run on the event loop

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    def load(self) -> None:
        """Blocking: called in a thread."""
        raise NotImplementedError

    def close(self) -> None:
        """Free the model's memory."""

    def stats(self) -> dict[str, int]:
        """Cache counters for the heartbeat: prompt_tokens, cached_tokens, prefix_hits, cache_bytes."""
        return {}


class CancelFlag:
    """A per-request flag the engine checks between tokens."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()
