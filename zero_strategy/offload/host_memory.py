"""Hand freed heap memory back to the system, where the C library can (glibc).

The first step over offloaded state creates it in memory, a tile at a time, before the
tier moves it to disk. glibc keeps the freed blocks of a few MiB in its heap, pinned
there by the small long-lived allocations made meanwhile (each view's step count), so
the process would stay as large as if the state had never left. `malloc_trim` returns
those pages; it runs only when state was laid out afresh (the first step, a load, the
EMA's first update), never in a steady step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def _find_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return None


_TRIM = _find_trim()


def return_freed_memory() -> None:
    if _TRIM is not None:
        _TRIM(0)
