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
    elements, each with its own state; each later optimizer's names the first's group
    (`alias_of`). What is counted once per element (an EMA, the weights in a checkpoint)
    is counted at the first."""

    unit: FlatUnit
    lo: int
    hi: int
    param: nn.Parameter
    group_index: int
    grad: torch.Tensor | None = None
    alias_of: int | None = None


def slot_parts(view: OptimizerView) -> list[tuple[int, int, int]]:
    """(slot index, start, end) of each trainable model parameter in `view`, the range
    relative to the view: the pieces the optimizer holds back (no gradient) or steps
    with their own counts (`optim/step_lag`)."""
    unit = view.unit
    parts = []
    for index, slot in enumerate(unit.layout.slots):
        if not slot.trainable:
            continue
        mine_lo, mine_hi = unit.mine_of(slot)
        lo = max(mine_lo - unit.opt_start, view.lo)
        hi = min(mine_hi - unit.opt_start, view.hi)
        if lo < hi:
            parts.append((index, lo - view.lo, hi - view.lo))
    return parts
