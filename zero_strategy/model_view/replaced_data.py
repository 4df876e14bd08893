"""Parameters whose `.data` was replaced outside the engine.

`param.data = tensor` is how some code writes weights: Lightning's ModelPruning resets
the surviving weights to their initial values that way (the lottery ticket),
`torch.nn.utils.prune.remove` makes a pruning permanent with it, and a training step may
pin a weight by hand. Under DDP the written values are the parameter, and training goes
on from them. Here a parameter shows its unit's memory (stages 0-2: a view of the flat
buffer, which each step refreshes from the fp32 master; stage 3: a view of the gather
buffer, or a placeholder between uses). A replaced `.data` is a view no longer: the
module would compute with the written values while the step's updates land in a buffer
nothing reads, or (stage 3) the next gather would silently put the old values back.

So the written values are adopted: they go into this rank's slice of the master (and its
stage-3 shard), into the full buffer where the unit is whole, and the parameter shows the
unit's memory again. The engine looks before each forward and wherever the weights are
read or written outside forward (a step, a checkpoint, a state dict:
`wait_for_parameters`); at stage 3 the gather schedule also looks at each unit just before
a gather points its parameters anew and before a free (`adopt_unit`), so a write made in
a training step before the module runs, or while it is gathered, is what it computes
with. Every rank adopts its own slice: no collective, as the write itself had none.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from ..units.flat_unit import FlatUnit
from .full_view import write_back_part, write_back_unit


def replaced_slots(unit: FlatUnit) -> tuple[dict[int, torch.Tensor], list[int]]:
    """`unit`'s parameters whose memory is no longer the unit's: (written values, a
    tensor of the same device and dtype to adopt, by index; the indices of values of
    another dtype on the same device, which are not adopted). A parameter moved to
    another device (`model.cpu()` for inference after training) is left as the user made
    it."""
    if unit.stage < 3 and unit.full is None:
        return {}, []
    written, converted = {}, []
    for index, values in unit.replaced().items():
        if values.device != unit.device:
            continue
        if values.dtype == unit.compute_dtype:
            written[index] = values
        else:
            converted.append(index)
    return written, converted


def converted_warning(names: list[str], dtype: torch.dtype, stage: int) -> str:
    """The warning for parameters whose `.data` now holds another dtype than the engine's
    (`model.half()`, or values assigned in fp32 to a bf16 model)."""
    fate = (
        "are ignored: at stage 3 the parameters show the engine's values again at their next gather"
        if stage >= 3
        else "are left as they are, and the optimizer's steps no longer reach them"
    )
    return (
        f"The .data of parameter(s) {names} was replaced by tensors of another dtype than "
        f"the ZeRO engine's {dtype}: they {fate}. To change the weights and keep "
        f"training, assign values of dtype {dtype} (or write them in place, or inside "
        "engine.gathered_parameters())."
    )


def converted_error(names: list[str], dtype: torch.dtype) -> ValueError:
    """The refusal of a training forward (stages 0-2) whose trained parameters now hold
    another dtype than the engine's: the optimizer's steps could not reach them (at stage
    2 they went on silently without them; at stages 0-1 the backward failed on torch's
    gradient dtype check). At stage 3 the next gather shows the engine's values again
    anyway: the conversion is named and dropped, and training goes on."""
    return ValueError(
        f"The .data of trained parameter(s) {names} holds another dtype than the ZeRO "
        f"engine's {dtype} (model.half() or model.to(dtype) after the engine took the "
        "model): the optimizer's steps cannot reach them, so a forward with gradients "
        "enabled is refused. To train in reduced precision, keep the model as it was and "
        "set ZeroConfig(compute_dtype='bf16' or 'fp16') (the fp32 masters stay exact); for "
        "inference in another dtype, load engine.full_state_dict() into a model of its own."
    )


@torch.no_grad()
def adopt_replaced(unit: FlatUnit, written: dict[int, torch.Tensor]) -> None:
    """Take the values written to `unit`'s parameters (index -> tensor) into this rank's
    master slice (and stage-3 shard) and, where the unit is whole, its full buffer; the
    parameters show the unit's memory again."""
    for index, values in written.items():
        slot = unit.layout.slots[index]
        if tuple(values.shape) != tuple(slot.shape):
            unit.show_own(index)  # refused: the parameter shows the engine's values again
            raise ValueError(
                f"The .data of parameter {slot.name!r} was replaced by a tensor of shape "
                f"{tuple(values.shape)}, but it has shape {tuple(slot.shape)} in the ZeRO "
                "engine. Assign a tensor of the same shape, or write in place "
                "(param.data.copy_(values))."
            )
        flat = values.detach().reshape(-1)
        if unit.full is not None:
            unit.full[slot.offset : slot.end].copy_(flat)
            unit.point_param_at(index)
            continue
        lo, hi = unit.mine_of(slot)  # stage 3, freed: this rank's part goes to its slice
        if lo < hi:
            write_back_part(unit, lo, flat[lo - slot.offset : hi - slot.offset])
        if not unit.gathering:  # (in flight: its gather is stale there; taken again after)
            unit.show_freed(index)
    if unit.full is not None:
        write_back_unit(unit)


class ReplacedDataWatch:
    """The engine's look for replaced `.data`, before each forward and in every
    `wait_for_parameters` (and at stage 3 around each gather and free: `adopt_unit`):
    written values adopted, another dtype named once."""

    def __init__(
        self,
        units: list[FlatUnit],
        stage: int,
        compute_dtype: torch.dtype,
        finish_publishing: Callable[[], None],
    ):
        self.units = units
        self.stage = stage
        self.compute_dtype = compute_dtype
        self.finish_publishing = finish_publishing  # a post-step gather into the buffers
        self._named: set[str] = set()  # replaced by another dtype, warned once

    def look(self, training: bool = False) -> None:
        """Adopt what was written; name another dtype. With `training` (a forward with
        gradients enabled: a backward and a step may follow), trained parameters of
        another dtype are refused at stages 0-2 (`converted_error`)."""
        found = [(unit, *replaced_slots(unit)) for unit in self.units]
        converted = [(unit, indices) for unit, _, indices in found]
        if training and self.stage < 3:
            self._refuse_converted_trained(converted)
        self._name_converted(converted)
        written = [(unit, values) for unit, values, _ in found if values]
        if not written:
            return
        self.finish_publishing()  # a post-step gather into the same buffers first
        for unit, values in written:
            adopt_replaced(unit, values)

    def taken(self, unit: FlatUnit) -> dict[int, torch.Tensor]:
        """Stage 3, before a gather points `unit`'s parameters anew: what was written to
        them (a dtype conversion named, and dropped)."""
        written, converted = replaced_slots(unit)
        self._name_converted([(unit, converted)])
        return written

    def adopt_unit(self, unit: FlatUnit, written: dict[int, torch.Tensor] | None = None) -> None:
        """Stage 3: adopt what was written to `unit`'s parameters (`written`, taken before
        a gather pointed them anew; by default what they hold now, before a free)."""
        written = self.taken(unit) if written is None else written
        if written:
            adopt_replaced(unit, written)

    def _refuse_converted_trained(self, found: list[tuple[FlatUnit, list[int]]]) -> None:
        trained = [
            unit.layout.slots[i].name
            for unit, indices in found
            for i in indices
            if unit.layout.slots[i].trainable
        ]
        if trained:
            raise converted_error(trained, self._dtype_of(found))

    def _dtype_of(self, found: list[tuple[FlatUnit, list[int]]]) -> torch.dtype:
        """The dtype the engine holds the named parameters in: the engine's, or where all
        are kept in fp32 (`layout/fp32_params.py`), fp32."""
        dtypes = {unit.compute_dtype for unit, indices in found if indices}
        return dtypes.pop() if len(dtypes) == 1 else self.compute_dtype

    def _name_converted(self, found: list[tuple[FlatUnit, list[int]]]) -> None:
        """Warn once per parameter whose `.data` now holds another dtype; at stage 3 the
        engine's values are shown again (a gather would put them back anyway)."""
        converted = [
            unit.layout.slots[i].name
            for unit, indices in found
            for i in indices
            if unit.layout.slots[i].name not in self._named
        ]
        if converted:
            self._named.update(converted)
            warnings.warn(
                converted_warning(converted, self._dtype_of(found), self.stage), stacklevel=5
            )
        if self.stage >= 3:
            for unit, indices in found:
                for index in indices:
                    unit.show_own(index)
