"""A cache for the small models the project builds itself (tiny diffusers, overfitted whisper, ...).

Building some of them takes tens of seconds (overfitting), so a build is kept under
`$CODERAI_MODEL_CACHE` (default `$XDG_CACHE_HOME/coderai/models`, i.e. `~/.cache/coderai/models`) by name and recipe version, written to a temporary
folder and renamed into place, so a half-built model is never seen and concurrent builders do not collide.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """Where built models are kept."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = os.environ.get("CODERAI_MODEL_CACHE") or os.path.join(cache, "coderai", "models")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def cached_build(name: str, version: str, build: Callable[[Path], object]) -> Path:
    """The folder of model `name` at recipe `version`, running `build(folder)` once if it is not there yet.

    `build` writes into the empty folder it is given; change `version` whenever the recipe changes.
    """
    root = cache_root()
    final = root / f"{name}-{version}"
    if final.exists():
        return final
    with open(root / f".{name}-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second builder waits here, then finds the folder
        if final.exists():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            build(tmp)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
