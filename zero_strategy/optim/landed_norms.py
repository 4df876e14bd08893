"""The global gradient norm with the gradient shards on disk: taken as they land.

Clipping needs the norm of every gradient before the step, and the offloaded shards are
in memory only while their reductions land and while they step. So each unit's part of
the norm is noted when its reduction has landed (the shard is in memory then), and the
norm adds up the notes: no pass over the file. The notes are the per-slice L2 norms that
the in-memory sum of squares takes (`kernels.norm.reference_sum_squares`: torch's foreach
norm per slice, then the squares summed in order), so the result is the same to the bit.
A unit changed since its note (a scale, a clamp) or never landed is measured afresh.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..layout.partition import Segment
from ..private_api import foreach_norm

Slices = Sequence[tuple[Segment, torch.Tensor]]  # (the groups' segment, slice of the gradient)


class LandedNorms:
    def __init__(self, dtype: torch.dtype):
        # fp64 training sums in fp64 over every slice, as the engine's in-memory norm does;
        # otherwise in fp32 over the non-empty ones, as the reference kernel does.
        self.dtype = dtype
        self._by_unit: dict[int, list[tuple[Segment, torch.Tensor]]] = {}

    def note(self, unit_index: int, slices: Slices) -> None:
        """The unit's gradient as it is now (in memory): its slices' norms."""
        if self.dtype != torch.float64:
            slices = [(seg, t.to(torch.float32)) for seg, t in slices if t.numel()]
        norms = foreach_norm([t for _, t in slices], 2.0) if slices else []
        self._by_unit[unit_index] = [(seg, n) for (seg, _), n in zip(slices, norms)]

    def has(self, unit_index: int) -> bool:
        return unit_index in self._by_unit

    def forget(self, unit_index: int) -> None:
        self._by_unit.pop(unit_index, None)

    def clear(self) -> None:
        self._by_unit.clear()

    def sum_squares(self, unit_indices: Sequence[int], groups: set[int] | None) -> torch.Tensor:
        """Sum of squares of the noted units' gradients (of `groups`' slices, or all), in
        unit order, as a 1-element tensor."""
        norms = [
            n for index in unit_indices for seg, n in self._by_unit[index] if seg.in_groups(groups)
        ]
        if not norms:
            dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
            return torch.zeros(1, dtype=dtype)
        return torch.stack(norms).square().sum().reshape(1)
