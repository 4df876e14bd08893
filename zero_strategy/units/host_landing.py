"""Reduced gradients on their way to fp32 shards in host memory (the optimizer offloaded
from an accelerator).

A unit's reduction lands on the device; its fp32 gradient shard is on the host. A copy
that backward waited for would stall it at every landing: the CPU could not queue the
next kernels until the device had run every one before. Instead each reduced gradient is
copied into a page-locked host buffer without waiting, an event recorded after it, and
added to its shard later: the oldest ones while more than `budget` bytes are pending
(done long since, as a rule), the rest at the end of backward (`finish`), before
anything reads the shards. A unit's whole reduced shard goes this way, or one
parameter's part of it when parameters are reduced one by one.
In pageable memory (no page-locked host: a disk tier, or the CPU stand-in of the tests)
the copy is a plain one and only the add is deferred.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .flat_unit import FlatUnit


@dataclass
class _Pending:
    unit: FlatUnit
    staged: torch.Tensor  # the reduced gradient, in host memory
    at: int | None  # one parameter's part: its offset in the shard (None: the whole)
    copied: torch.cuda.Event | None  # recorded after the copy (page-locked only)


class HostLandings:
    def __init__(self, land: Callable[[FlatUnit, torch.Tensor, int | None], None], budget: int):
        self.land = land  # adds a staged gradient into its unit's shard (at an offset)
        self.budget = budget  # bytes pending beyond the newest
        self.pending: deque[_Pending] = deque()
        self._bytes = 0  # of the pending ones

    def send(self, unit: FlatUnit, reduced: torch.Tensor, at: int | None = None) -> None:
        """Start `reduced` (on the device) on its way to `unit`'s shard: the whole of
        it, or one parameter's part at offset `at`."""
        staged = torch.empty(
            reduced.shape, dtype=reduced.dtype, device=unit.host, pin_memory=unit.pin
        )
        staged.copy_(reduced, non_blocking=unit.pin)
        copied = None
        if unit.pin:  # on the stream of the device the copy is queued on
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(reduced.device))
        self.pending.append(_Pending(unit, staged, at, copied))
        self._bytes += staged.nbytes
        while len(self.pending) > 1 and self._bytes - staged.nbytes > self.budget:
            self._land_oldest()

    def finish(self) -> None:
        """Every pending gradient added to its shard (in the order they were sent)."""
        while self.pending:
            self._land_oldest()

    def drop(self) -> None:
        """Let go of the pending ones (a peer is gone, or the process ends after an
        error): the shards are not used again before a zero_grad or a load."""
        self.pending.clear()
        self._bytes = 0

    def nbytes(self) -> int:
        return self._bytes

    def tensors(self) -> list[torch.Tensor]:
        """The host buffers held now (`comm_buffers`: host memory on an accelerator)."""
        return [p.staged for p in self.pending]

    def _land_oldest(self) -> None:
        pending = self.pending.popleft()
        self._bytes -= pending.staged.nbytes
        if pending.copied is not None:
            pending.copied.synchronize()
        self.land(pending.unit, pending.staged, pending.at)
