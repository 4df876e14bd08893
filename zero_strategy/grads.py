"""Gradient reduction: post-accumulate-grad hooks fill each unit's flat gradient buffer; a
unit whose gradients are all in is reduced at once, asynchronously, while backward goes on.

- Stages 0-1 keep the full gradient buffer: each parameter's .grad is a view of it, and
  it is all-reduced in place (averaged), so .grad holds the global gradient as under DDP.
- Stages 2-3 reduce-scatter the buffer and keep only this rank's slice, accumulated in
  fp32 across micro-batches; the full buffer lives only from a unit's first gradient to
  the end of its reduction.

Under `no_sync()`, gradients accumulate locally and nothing is communicated; the next
synchronised backward reduces everything. At the end of a synchronised backward every
trainable unit has been reduced exactly once on every rank (units that got no gradient
are reduced with zeros), so collectives pair up across ranks whatever was used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .comm import Communicator
from .flat_unit import FlatUnit


@dataclass
class _InFlight:
    unit: FlatUnit
    work: object
    sent: torch.Tensor  # the full buffer that was reduced
    out: torch.Tensor  # where this rank's reduced slice lands


class GradReducer:
    def __init__(
        self,
        units: list[FlatUnit],
        comm: Communicator,
        stage: int,
        overlap: bool,
        reduce_dtype: torch.dtype,
        on_unit_ready: Callable[[FlatUnit], None],
        on_backward_end: Callable[[], None],
    ):
        self.units = units
        self.comm = comm
        self.stage = stage
        self.world = comm.dp.world_size
        self.overlap = overlap
        self.reduce_dtype = reduce_dtype
        self.on_unit_ready = on_unit_ready
        self.on_backward_end = on_backward_end
        self.sync = True
        self.in_flight: list[_InFlight] = []
        self._ready: dict[int, int] = {}  # unit index -> grads received this backward
        self._launched: set[int] = set()
        self._callback_queued = False
        self._trainable_count = {
            u.layout.index: sum(s.trainable for s in u.layout.slots) for u in units
        }
        self.handles = []
        for unit in units:
            for slot_index, (slot, p) in enumerate(zip(unit.layout.slots, unit.params)):
                if slot.trainable:
                    self.handles.append(
                        p.register_post_accumulate_grad_hook(self._make_hook(unit, slot_index))
                    )

    # ---------------------------------------------------------------- hooks
    def backward_started(self) -> None:
        """Queue the end-of-backward callback once per backward pass."""
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _make_hook(self, unit: FlatUnit, slot_index: int):
        slot = unit.layout.slots[slot_index]

        def hook(p: nn.Parameter) -> None:
            self.backward_started()
            if p.grad is None:
                return
            if self.stage < 2:
                view = unit.grad_full[slot.offset : slot.end].view(slot.shape)
                if p.grad.data_ptr() != view.data_ptr():  # .grad was reset to None
                    view.copy_(p.grad)
                    p.grad = view
            else:
                if unit.grad_full is None:
                    unit.grad_full = torch.zeros(
                        unit.layout.padded_numel, dtype=unit.compute_dtype, device=unit.device
                    )
                unit.grad_full[slot.offset : slot.end].add_(p.grad.reshape(-1))
                p.grad = None
            idx = unit.layout.index
            self._ready[idx] = self._ready.get(idx, 0) + 1
            if self._ready[idx] == self._trainable_count[idx]:
                self.on_unit_ready(unit)
                if self.sync and self.overlap:
                    self._launch(unit)

        return hook

    def _finish_backward(self) -> None:
        self._callback_queued = False
        if self.sync:
            for unit in self.units:
                if unit.layout.trainable and unit.layout.index not in self._launched:
                    self._launch(unit)
            self.wait()
            self._launched.clear()
        self._ready.clear()
        self.on_backward_end()

    # ---------------------------------------------------------------- reduction
    def _launch(self, unit: FlatUnit) -> None:
        self._launched.add(unit.layout.index)
        if unit.layout.numel == 0:
            return
        if unit.grad_full is None:  # no gradient reached this unit on this rank
            unit.grad_full = torch.zeros(
                unit.layout.padded_numel, dtype=unit.compute_dtype, device=unit.device
            )
        sent = (
            unit.grad_full
            if unit.grad_full.dtype == self.reduce_dtype
            else unit.grad_full.to(self.reduce_dtype)
        )
        if self.world > 1:
            sent.div_(self.world)  # average; dividing first keeps fp16 sums in range
        if self.stage < 2:
            out = sent
            work = self.comm.all_reduce_sum(sent, async_op=True)
        else:
            start, end = unit.layout.shard_range(unit.rank)
            out = (
                sent[start:end]
                if self.comm.reduce_scatter_via_all_reduce or self.world == 1
                else (torch.empty(end - start, dtype=sent.dtype, device=sent.device))
            )
            work = self.comm.reduce_scatter_sum(sent, out, async_op=True)
            unit.grad_full = None
        self.in_flight.append(_InFlight(unit, work, sent, out))

    def wait(self) -> None:
        """Finish every reduction in flight and land the results in the fp32 slices."""
        for job in self.in_flight:
            job.work.wait()
            unit = job.unit
            if self.stage < 2:
                if job.sent is not unit.grad_full:
                    unit.grad_full.copy_(job.sent)
                mine = unit.grad_full[unit.opt_start : unit.opt_end]
                if unit.grad_opt.data_ptr() != mine.data_ptr():
                    unit.grad_opt.copy_(mine)
            else:
                unit.grad_opt.add_(job.out)
        self.in_flight.clear()

    def zero_grad(self) -> None:
        for unit in self.units:
            if unit.grad_opt is not None:
                unit.grad_opt.zero_()
            if self.stage >= 2:
                unit.grad_full = None
            elif unit.grad_full is not None:
                unit.grad_full.zero_()
                unit.attach_param_grads()
