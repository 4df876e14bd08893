"""The largest bytes of each kind a rank has held since the last reset, exactly.

A current report says what is held now; the question a user with a model that barely
fits asks is what was held at the worst moment of a step. The engine's transient memory
(gathered units, gradient buffers, the optimizer state's first creation) only grows at a
few places, and each of them calls `sample(grew=True)` right after it allocated: the
largest value seen at those moments is the true peak, not a sampled guess, since between
two of them memory only shrinks.

With a timeline requested, every change (shrinks too) is kept with its time, for plots of
one step's memory (`benchmarks/memory_timeline.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class MemoryPeaks:
    def __init__(self, measure: Callable[[], dict[str, int]]) -> None:
        self._measure = measure
        self.peaks: dict[str, int] = {}
        self.timeline: list[tuple[float, dict[str, int]]] | None = None
        self.active = False  # the engine turns sampling on once its tensors exist

    def sample(self, grew: bool = True) -> None:
        """Record the bytes held now. Called after every allocation the engine makes for
        transient memory (`grew`), and after frees when a timeline is recorded."""
        if not self.active or (not grew and self.timeline is None):
            return
        now = self._measure()
        for kind, value in now.items():
            if value > self.peaks.get(kind, 0):
                self.peaks[kind] = value
        if self.timeline is not None:
            self.timeline.append((time.perf_counter(), now))

    def reset(self, record_timeline: bool = False) -> None:
        """Start over from what is held now (the peaks become the current bytes)."""
        self.active = True
        self.timeline = [] if record_timeline else None
        self.peaks = {}
        self.sample()
