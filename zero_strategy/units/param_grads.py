"""Stages 0-1: each parameter's `.grad` as a view of its unit's flat gradient buffer.

Autograd then accumulates in place and the buffer is reduced without a copy. From a
`zero_grad()` to the next backward the views are hidden (`.grad` reads None, as a DDP
model's does), and after a synchronised backward so are those of the parameters no rank
gave a gradient to (as DDP with `find_unused_parameters=True` leaves them); which ones the engine hid is remembered, so that they are not taken for a
`zero_grad()` or `p.grad = None` that bypassed the engine.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ..layout.partition import ParamSlot
from ..tensor_parallel import set_local_grad


class ParamGradViews:
    def __init__(self, slots: list[ParamSlot], params: list[nn.Parameter]):
        self._slots = slots
        self._params = params  # aligned with slots
        self._hidden: set[int] = set()
        # Views attached from None since the last synchronised backward: DDP leaves such
        # a `.grad` None when no rank gives the parameter a gradient.
        self._attached: set[int] = set()

    def show(self, buffer: torch.Tensor) -> None:
        """Each trainable param's `.grad` that reads None becomes its view of `buffer`. A
        `.grad` autograd has just written is left for the reducer to copy in."""
        for index, (slot, p) in enumerate(zip(self._slots, self._params)):
            if slot.trainable and p.grad is None:
                set_local_grad(p, buffer[slot.offset : slot.end].view(slot.shape))
                self._attached.add(index)
        self._hidden.clear()

    def zero_shown(self, groups: set[int] | None = None) -> None:
        """`zero_grad(set_to_none=False)` (of the params in any of `groups`, or all):
        each shown `.grad` holds real zeros, which the step takes as a gradient (as torch
        steps a zeroed `.grad`); a hidden one stays None, as torch leaves a None `.grad`."""
        for slot, p in zip(self._slots, self._params):
            chosen = groups is None or not groups.isdisjoint(slot.groups)
            if slot.trainable and chosen and p.grad is not None:
                p.grad.zero_()

    def hide(self, groups: set[int] | None = None) -> None:
        """`.grad` reads None for the params in any of `groups` (all when None) until the
        next `show`. A parameter two optimizers step loses its gradient to either's
        `zero_grad()`, as its one `.grad` does in one process."""
        for index, (slot, p) in enumerate(zip(self._slots, self._params)):
            if slot.trainable and (groups is None or not groups.isdisjoint(slot.groups)):
                set_local_grad(p, None)
                self._hidden.add(index)

    def take_attached(self, buffer: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(index, its range of `buffer`) of each param whose view was attached from None
        since the last synchronised backward, which this one ends. A tensor-parallel
        block is left shown: its position alone cannot tell (its block may be empty)."""
        attached = [
            (index, buffer[self._slots[index].offset : self._slots[index].end])
            for index in sorted(self._attached)
            if self._params[index].grad is not None and not self._slots[index].tensor_sharded
        ]
        self._attached.clear()
        return attached

    def hide_at(self, index: int) -> None:
        """`.grad` reads None for the param at `index` until the next `show`: no rank
        gave it a gradient, and DDP leaves a globally unused parameter's `.grad` None."""
        set_local_grad(self._params[index], None)
        self._hidden.add(index)

    def cleared_elsewhere(self) -> Iterator[ParamSlot]:
        """The slots whose `.grad` went None since the last `show`, other than by `hide`:
        a `zero_grad()` or `p.grad = None` that did not come through the engine."""
        for index, (slot, p) in enumerate(zip(self._slots, self._params)):
            if slot.trainable and p.grad is None and index not in self._hidden:
                yield slot

    def live_groups(self) -> set[int]:
        """The param groups of the params whose `.grad` shows a gradient buffer."""
        return {
            g
            for slot, p in zip(self._slots, self._params)
            if p.grad is not None
            for g in slot.groups
        }
