"""Gradient reductions started and not yet landed, oldest first.

The reducer bounds them (by count for whole units, by bytes for parameters reduced one
by one) and lands the oldest first; `memory_report` counts what they hold beyond the
units' own gradient buffers without walking them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .flat_unit import FlatUnit


@dataclass
class InFlight:
    unit: FlatUnit
    work: object
    sent: torch.Tensor  # the full buffer that was reduced (or one parameter's gradient)
    out: torch.Tensor | None  # where this rank's reduced slice lands (None: `slots`')
    # Parameters reduced on their own or packed (`grad_buckets`): their slots in the
    # unit, each at `starts[i]` of `sent`. Empty: the whole unit.
    slots: tuple[int, ...] = ()
    starts: tuple[int, ...] = ()
    counted: int = 0  # bytes it adds to comm_buffers (0: `sent` is the unit's gradients)

    def held(self) -> list[torch.Tensor]:
        """The memory the reduction holds: what it sends, and with pairwise sends the
        buffers the other ranks' parts land in."""
        return [self.sent, *getattr(self.work, "receive_buffers", ())]


class InFlightQueue:
    """The reductions in flight, and the bytes they hold beyond the units' gradient
    buffers (each buffer counted once)."""

    def __init__(self) -> None:
        self._jobs: list[InFlight] = []
        self.sent_bytes = 0

    def push(self, job: InFlight, counted: bool) -> None:
        """Add `job`; `counted`: what it holds is not a unit's gradient buffer (already
        counted as gradients), so it adds to `sent_bytes`."""
        if counted:
            job.counted = sum(t.nbytes for t in job.held())
        self._jobs.append(job)
        self.sent_bytes += job.counted

    def pop(self) -> InFlight:
        """The oldest reduction, no longer counted."""
        job = self._jobs.pop(0)
        self.sent_bytes -= job.counted
        return job

    def clear(self) -> None:
        self._jobs.clear()
        self.sent_bytes = 0

    def tensors(self) -> list[torch.Tensor]:
        return [t for job in self._jobs for t in job.held()]

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[InFlight]:
        return iter(self._jobs)
