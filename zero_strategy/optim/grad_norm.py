"""The global L2 norm of the gradients: each rank sums the squares of what it owns, then
one all-reduce over every rank. Every element is counted exactly once: a unit with several
copies counts its first copy's shards, stage 0 counts a copy on its first rank only, and
with tensor parallelism a parameter whole on every tensor position counts at position 0.

With the gradient shards on disk the squares are noted as each shard lands
(`LandedNorms`), so the norm never reads the file back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm.topology import ProcessGroups
from ..kernels import multi_tensor_sum_squares, reference_sum_squares
from ..layout.partition import Segment
from ..private_api import foreach_norm
from ..units.flat_unit import FlatUnit
from .landed_norms import LandedNorms


class GradNorm:
    def __init__(
        self,
        units: Sequence[FlatUnit],
        stage: int,
        groups: ProcessGroups,
        master_dtype: torch.dtype,
        device: torch.device,
        host: torch.device,
        offloaded: bool,
    ):
        self.units = units
        self.stage = stage
        self.groups = groups
        self.master_dtype = master_dtype
        self.device = device
        self.host = host  # where the fp32 gradient shards are (summed there)
        self.offloaded = offloaded  # the gradient shards live in a file between uses
        self._landed = LandedNorms(master_dtype)

    def global_norm(self, groups: set[int] | None) -> torch.Tensor:
        """The L2 norm over every rank of the gradients of `groups` (all when None), as
        the gradients hold it now (loss scale included). Collective over every rank."""
        sq = self._local_sum_squares(groups)
        self.groups.everyone.control_all_reduce(sq)  # tensor-parallel ranks too
        return sq.sqrt()[0]

    def note_landed(self, unit: FlatUnit) -> None:
        """A unit's reduced gradient is all in its shard (in memory now): with the shards
        offloaded, note its part of the norm before it leaves."""
        if self.offloaded:
            self._landed.note(unit.layout.index, self._norm_slices(unit))

    def forget(self, unit: FlatUnit) -> None:
        """The unit's gradient changed since its note: measure it afresh."""
        self._landed.forget(unit.layout.index)

    def clear(self) -> None:
        self._landed.clear()

    def _local_sum_squares(self, groups: set[int] | None) -> torch.Tensor:
        """This rank's part of the squared global norm, as a 1-element tensor."""
        if self.offloaded:  # the norms noted as the shards landed
            for unit in self.units:
                if not self._landed.has(unit.layout.index):
                    with unit.grads_resident():
                        self.note_landed(unit)
            indices = [unit.layout.index for unit in self.units]
            return self._landed.sum_squares(indices, groups).to(self.device)
        shards = [
            part
            for unit in self.units
            for seg, part in self._norm_slices(unit)
            if seg.in_groups(groups)
        ]
        # One fused pass over every shard (Triton on CUDA, torch's foreach norm elsewhere).
        if not shards:
            return torch.zeros(1, dtype=self.master_dtype, device=self.device)
        if self.master_dtype == torch.float64:  # fp64 training: the norm in fp64, as torch's
            norms = torch.stack(foreach_norm(shards, 2.0))
            return norms.square().sum().reshape(1).to(self.device)
        if self.host != self.device:  # the shards in host memory: summed there
            return reference_sum_squares(shards).reshape(1).to(self.device)
        return multi_tensor_sum_squares(shards).reshape(1).to(self.device)

    def _norm_slices(self, unit: FlatUnit) -> list[tuple[Segment, torch.Tensor]]:
        """(segment, slice of the fp32 gradient shard) that this rank counts in the
        global norm, for `unit`: each element once, whichever optimizers hold it."""
        if not (unit.group.primary and (self.stage > 0 or unit.group.rank == 0)):
            return []
        return [
            (seg, unit.grad_opt[lo - unit.opt_start : hi - unit.opt_start])
            for seg in unit.layout.segments(unit.opt_start, unit.opt_end)
            for lo, hi in self._counted_in_norm(unit, seg.start, seg.end)
        ]

    def _counted_in_norm(self, unit: FlatUnit, start: int, end: int) -> list[tuple[int, int]]:
        """The ranges of [start, end) this rank counts: all of them, but with tensor
        parallelism a parameter whole on every tensor-parallel rank only at position 0
        (its shards count everywhere: each position holds its own)."""
        if self.groups.tensor is None or self.groups.tensor.rank == 0:
            return [(start, end)]
        return [
            (max(start, s.offset), min(end, s.end))
            for s in unit.layout.slots
            if s.tensor_sharded and max(start, s.offset) < min(end, s.end)
        ]
