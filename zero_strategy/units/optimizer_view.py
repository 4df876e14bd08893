"""One parameter of a re-pointed optimizer: a 1-D view of one unit's fp32 master.

The optimizer, the tiers that hold its state and the checkpoint format all speak of the
optimizer's parameters this way; it lives below all three."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .flat_unit import FlatUnit


@dataclass(frozen=True)
class OptimizerView:
    """One parameter of the re-pointed optimizer: `param` is a 1-D view of `unit`'s fp32
    master over [lo, hi) of this rank's slice; `grad` is the gradient there,
    `unit.grad_opt[lo:hi]`, made once (an offloaded shard's memory is not there to view
    between its uses).

    A parameter that several optimizers step has a view per optimizer over the same
    elements, each with its own state: the first optimizer's names the later groups
    (`later_groups`), each later one the first's group (`alias_of`). What is counted once
    per element (an EMA, a norm, the weights in a checkpoint) is counted at the first."""

    unit: FlatUnit
    lo: int
    hi: int
    param: nn.Parameter
    group_index: int
    grad: torch.Tensor | None = None
    later_groups: tuple[int, ...] = ()
    alias_of: int | None = None

    def in_groups(self, groups: set[int] | None) -> bool:
        """Whether stepping `groups` (all when None) changes these elements."""
        return (
            groups is None or self.group_index in groups or not groups.isdisjoint(self.later_groups)
        )
