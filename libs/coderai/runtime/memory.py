"""Giving freed memory back to the OS in a long-running service.

CPython keeps small objects in its own arenas, which it unmaps once empty; everything larger (a dict's table, a
bytes buffer, what uvloop and msgspec allocate) comes from the C library's heap. glibc returns that heap's free
space only from its top, so a service whose tables grow, shrink and move keeps the high-water mark of its churn
as resident memory. `malloc_trim(0)` releases the free pages wherever they are. It is a no-op elsewhere (musl,
macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


def trim_heap() -> bool:
    """Release the C heap's free pages to the OS; True where the C library could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
