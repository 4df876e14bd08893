"""Hand freed heap memory back to the system, where the C library can (glibc).

The first step over offloaded state creates it in memory, a tile at a time, before the
tier moves it to disk. glibc keeps the freed blocks of a few MiB in its heap, pinned
there by the small long-lived allocations made meanwhile (each view's step count), so
the process would stay as large as if the state had never left. `malloc_trim` returns
those pages; it runs only when state was laid out afresh (the first step, a load, the
EMA's first update), never in a steady step.

Offloaded parameter shards come and go at every gather and step, a few MiB each. glibc
serves allocations that size from its heap once one of them has been freed (its mmap
threshold rises to the largest block freed), and freed blocks there stay resident,
fragmented between live ones: the process keeps the shards' size in RAM after all.
`free_large_blocks_at_once` pins the threshold (as MALLOC_MMAP_THRESHOLD_ would), so that
large blocks are mapped for themselves and unmapped when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _find(name: str) -> Callable[..., int] | None:
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or None), name)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return None


_TRIM = _find("malloc_trim")
_MALLOPT = _find("mallopt")


def free_large_blocks_at_once(threshold: int = 1 << 20) -> None:
    """Blocks of `threshold` bytes or more are mapped for themselves from now on, and go
    back to the system when freed (process-wide; left alone when the user set
    MALLOC_MMAP_THRESHOLD_)."""
    if _MALLOPT is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        _MALLOPT(_M_MMAP_THRESHOLD, threshold)


def return_freed_memory() -> None:
    if _TRIM is not None:
        _TRIM(0)
