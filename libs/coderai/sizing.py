"""The memory rules every service agrees on: what one loaded copy of a model needs, and what a node offers.

A copy needs `memory_mb` if the config says so, else its file size x 1.2 plus 256 MB (weights plus KV cache and
runtime; an estimate that errs large); a folder model counts every file in it. A node offers 90 % of its GPU
memory when it reports one, else of its RAM. The scheduler places by these, the catalogue says where a model fits.
"""

from __future__ import annotations

import os

from coderai.contracts import Heartbeat, ModelConfig

MB = 1 << 20
OVERHEAD = 256 * MB
USABLE = 0.9
UNKNOWN_CAPACITY = 1 << 62


def path_bytes(path: str) -> int:
    """Bytes of a model file, or of every file in a model folder; 0 when it is not on this machine."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        total = 0
        for root, _dirs, files in os.walk(path):
            for f in files:
                try:
                    total += os.path.getsize(os.path.join(root, f))
                except OSError:
                    pass
        return total
    try:
        return os.path.getsize(path)
    except OSError:
        return 0  # the file lives on the nodes only: count the overhead alone


def estimate_bytes(m: ModelConfig, file_size: int | None = None) -> int:
    if m.memory_mb:
        return m.memory_mb * MB
    if file_size is None:
        file_size = path_bytes(m.path)
    return int(file_size * 1.2) + OVERHEAD


def capacity(hb: Heartbeat) -> int:
    """What a node offers; a node that reports no memory at all is not refused anything."""
    total = hb.vram_total or hb.mem_total
    return int(total * USABLE) if total else UNKNOWN_CAPACITY
