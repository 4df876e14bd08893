"""Parameters whose `.data` was replaced outside the engine, at stages 0-2.

`param.data = tensor` is how some code writes weights: Lightning's ModelPruning resets
the surviving weights to their initial values that way (the lottery ticket), and
`torch.nn.utils.prune.remove` makes a pruning permanent with it. At stages 0-2 a
parameter is a view of its unit's flat buffer, which each step refreshes from the fp32
master. A replaced `.data` is a view no longer: the module would go on computing with the
written values while the step's updates land in a buffer nothing reads. Under DDP the
written values are the parameter, and training goes on from them.

Before each forward, and wherever the weights are read or written outside forward (a
step, a checkpoint, a state dict: `wait_for_parameters`), the engine finds such
parameters (a pointer comparison per parameter) and adopts what was written: the values
go into the flat buffer and into this rank's slice of the master, and the parameter is a
view again.
Stage 3 is not covered: there a parameter outside forward is an empty placeholder, and
writes to the full weights go through `engine.gathered_parameters()`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from ..tensor_parallel import local_tensor
from ..units.flat_unit import FlatUnit
from .full_view import write_back_unit


def replaced_slots(unit: FlatUnit) -> tuple[list[int], list[int]]:
    """The indices of `unit`'s parameters whose memory is no longer the flat buffer's:
    (written values: a tensor of the same device and dtype, to adopt; values of another
    dtype on the same device, which are not adopted). A parameter moved to another device
    (`model.cpu()` for inference after training) is left as the user made it."""
    full = unit.full
    if full is None:
        return [], []
    base, size = full.data_ptr(), full.element_size()
    written, converted = [], []
    for i, (slot, local) in enumerate(zip(unit.layout.slots, unit.locals)):
        if (
            slot.end == slot.offset
            or local.data_ptr() == base + slot.offset * size
            or local.device != full.device
        ):
            continue
        (written if local.dtype == full.dtype else converted).append(i)
    return written, converted


def converted_warning(names: list[str], dtype: torch.dtype) -> str:
    """The warning for parameters whose `.data` now holds another dtype than the engine's
    (`model.half()`, or values assigned in fp32 to a bf16 model)."""
    return (
        f"The .data of parameter(s) {names} was replaced by tensors of another dtype than "
        f"the ZeRO engine's {dtype}: they are left as they are, and the optimizer's steps "
        "no longer reach them. To change the weights and keep training, assign values of "
        f"dtype {dtype} (or write them in place, or inside engine.gathered_parameters())."
    )


@torch.no_grad()
def adopt_replaced(unit: FlatUnit, indices: list[int]) -> None:
    """Take the written values of `unit`'s parameters at `indices` into the flat buffer
    and this rank's master slice, and point the parameters back at the buffer."""
    for i in indices:
        slot, param = unit.layout.slots[i], unit.params[i]
        local = local_tensor(param)
        if tuple(local.shape) != tuple(slot.shape):
            raise ValueError(
                f"The .data of parameter {slot.name!r} was replaced by a tensor of shape "
                f"{tuple(local.shape)}, but it has shape {tuple(slot.shape)} in the ZeRO "
                "engine. Assign a tensor of the same shape, or write in place "
                "(param.data.copy_(values))."
            )
        unit.full[slot.offset : slot.end].copy_(local.detach().reshape(-1))
        unit.point_param_at(i)
    write_back_unit(unit)


class ReplacedDataWatch:
    """The engine's look for replaced `.data` (stages 0-2), before each forward and in
    every `wait_for_parameters`: written values adopted, another dtype named once."""

    def __init__(
        self,
        units: list[FlatUnit],
        stage: int,
        compute_dtype: torch.dtype,
        finish_publishing: Callable[[], None],
    ):
        self.units = units
        self.active = stage < 3
        self.compute_dtype = compute_dtype
        self.finish_publishing = finish_publishing  # a post-step gather into the buffers
        self._named: set[str] = set()  # replaced by another dtype, warned once

    def look(self) -> None:
        if not self.active:
            return
        found = [(unit, replaced_slots(unit)) for unit in self.units]
        converted = [
            unit.layout.slots[i].name
            for unit, (_, other) in found
            for i in other
            if unit.layout.slots[i].name not in self._named
        ]
        if converted:
            self._named.update(converted)
            warnings.warn(converted_warning(converted, self.compute_dtype), stacklevel=4)
        written = [(unit, slots) for unit, (slots, _) in found if slots]
        if not written:
            return
        self.finish_publishing()  # a post-step gather into the same buffers first
        for unit, slots in written:
            adopt_replaced(unit, slots)
