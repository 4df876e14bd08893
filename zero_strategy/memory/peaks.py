"""The largest bytes of each kind a rank has held since the last reset, exactly.

A current report says what is held now; the question a user with a model that barely
fits asks is what was held at the worst moment of a step. The engine's transient memory
(gathered units, gradients being reduced, pooled buffers) changes at a few places, and
each of them calls `sample()` right after: the largest value seen at those moments is the
true peak, not a sampled guess, since nothing else changes it in between. Model state (parameters, gradients, optimizer state) changes only in the
step, which calls `resync()` after it.

A sample must cost next to nothing (it runs after every gradient sent), so it reads only
the transient kinds, from counters (`measure_transient`); the whole ledger
(`measure_all`) is walked at a reset and after each step.

With a timeline requested, every sample is kept with its time, for plots of one step's
memory (`benchmarks/memory_timeline.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

TRANSIENT = ("gathered_parameters", "comm_buffers", "pooled")


class MemoryPeaks:
    def __init__(
        self,
        measure_all: Callable[[], dict[str, int]],
        measure_transient: Callable[[], dict[str, int]],
    ) -> None:
        self._measure_all = measure_all
        self._measure_transient = measure_transient
        self._steady: dict[str, int] = {}  # the kinds that change only in the step
        self.peaks: dict[str, int] = {}
        self.timeline: list[tuple[float, dict[str, int]]] | None = None
        self.active = False  # the engine turns sampling on once its tensors exist

    def sample(self) -> None:
        """Record the bytes held now. Called after every change the engine makes to its
        transient memory: allocations, and frees too (a free can move bytes into a pool,
        and the timeline shows the drops)."""
        if not self.active:
            return
        now = dict(self._steady)
        now.update(self._measure_transient())
        now["total"] = sum(v for k, v in now.items() if not k.startswith("host_"))
        self._record(now)

    def resync(self) -> None:
        """Walk everything held (after a step, whose optimizer may create its state)."""
        if not self.active:
            return
        now = self._measure_all()
        self._steady = {  # (host_* kinds, another memory, are not in the total)
            k: v
            for k, v in now.items()
            if k not in TRANSIENT and k != "total" and not k.startswith("host_")
        }
        self._record(now)

    def _record(self, now: dict[str, int]) -> None:
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
        self.resync()
