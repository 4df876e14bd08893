"""Gradient reduction: post-accumulate-grad hooks fill each unit's flat gradient buffer; a
unit whose gradients are all in is reduced at once, asynchronously, while backward goes on.

- Stages 0-1 keep the full gradient buffer: each parameter's .grad is a view of it, and
  it is all-reduced in place over every rank holding the unit's parameters (all ranks,
  or for MoE experts the ranks holding the same experts), so .grad holds the global
  gradient as under DDP.
- Stages 2-3 reduce-scatter the buffer over the unit's shard group and keep only this
  rank's slice, accumulated in fp32 across micro-batches; when the unit has several
  replicated copies (a placement's groups), the slice is then summed over its replica
  group. The full buffer lives only from a unit's first gradient to the end of its
  reduction.

Every unit is divided by the number of data-parallel ranks, whatever group shards it:
each rank's loss is the mean over its own batch, and the step follows the mean of those
(an expert's sum over its group already holds every rank's tokens, by the all-to-all).

Under `no_sync()`, gradients accumulate locally and nothing is communicated; the next
synchronised backward reduces everything. Reductions that pair with other ranks' go out
in one order every rank agrees on (`reduction_order`), whatever path each rank's backward
took: a gradient ready early waits for its turn, and at the end of a synchronised
backward every entry not yet sent goes out, as negative zeros where this rank has no
gradient (`no_gradient`: the optimizer then knows which parameters no rank used).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from ..private_api import (
    queue_backward_callback,
    storage_use_count,
    tree_flatten,
)
from ..tensor_parallel import local_grad, set_local_grad
from .flat_unit import FlatUnit
from .grad_buckets import GradBucket, GradBuckets
from .grad_hooks import GradHooks
from .host_landing import HostLandings
from .in_flight import InFlight, InFlightQueue
from .no_gradient import fill_no_gradient, got_no_gradient, no_gradient
from .reduction_order import MISSING, Entry, ReductionOrder, Turns

# Stages 2-3: at most this many full-size gradient buffers are being reduced at once;
# with the one being filled, that bounds the transient gradient memory to three units
# (with gloo's pairwise sends, plus each one's receive buffers: (world - 1) / world of a
# unit each).
MAX_IN_FLIGHT = 2
# Stages 2-3, parameters reduced one by one: at most this many bytes of gradients in
# flight besides the newest (the oldest lands first). Enough to keep gloo busy while
# backward computes the next ones.
DIRECT_IN_FLIGHT_BYTES = 64 * 2**20


class BufferPool:
    """Reuses full-size gradient buffers across units and steps.

    Fresh multi-megabyte CPU allocations are page-faulted and zeroed by the kernel on
    every backward; keeping the few buffers that are alive at once avoids that (the CUDA
    caching allocator does the same on GPUs). Its bytes are reported as `pooled`."""

    def __init__(self) -> None:
        self.free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self.free_bytes = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        stack = self.free.get((numel, dtype, device))
        if not stack:
            return torch.empty(numel, dtype=dtype, device=device)
        self.free_bytes -= stack[-1].nbytes
        return stack.pop()

    def give(self, buffer: torch.Tensor) -> None:
        stack = self.free.setdefault((buffer.numel(), buffer.dtype, buffer.device), [])
        if len(stack) <= MAX_IN_FLIGHT:  # more were alive only under no_sync: let them go
            stack.append(buffer)
            self.free_bytes += buffer.nbytes

    def tensors(self) -> list[torch.Tensor]:
        return [t for stack in self.free.values() for t in stack]


def to_host(reduced: torch.Tensor, unit: FlatUnit) -> torch.Tensor:
    """A reduced gradient where the unit's fp32 shard is (itself on the training device;
    a copy in host memory when the optimizer is offloaded from an accelerator)."""
    return reduced if unit.host == unit.device else reduced.to(unit.host)


def _sole_owner(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is the only tensor on its memory (so writing it in place cannot
    change another). Read from the storage's reference count: the tensor and the storage
    object made here hold one each. Without that count (another torch), assume not."""
    count = storage_use_count(tensor)
    return count is not None and count <= 2


class GradReducer:
    def __init__(
        self,
        units: list[FlatUnit],
        stage: int,
        overlap: bool,
        reduce_dtype: torch.dtype | None,
        on_unit_ready: Callable[[FlatUnit], None],
        on_backward_end: Callable[[], None],
        on_memory: Callable[[], None] = lambda: None,
        before_reduction: Callable[[], None] = lambda: None,
        before_backward_end: Callable[[], None] = lambda: None,
        on_grads_landed: Callable[[FlatUnit], None] = lambda unit: None,
        exchange: Callable[[list], list] | None = None,
        hold_reductions: Callable[[], bool] = lambda: False,
        not_run: Callable[[], set[int]] = set,
        reach: Callable[[int], None] = lambda position: None,
    ):
        """`exchange` gives every data-parallel rank's copy of a JSON-able value: the
        ranks agree once on the order their reductions go out in (`reduction_order`)."""
        self.units = units
        # Stage 3, ranks whose paths differ in this pass: no reduction goes out at its
        # turn here (reductions and gathers share the group, so they must interleave
        # alike on every rank).
        self.hold_reductions = hold_reductions
        # Instead this rank tells how far in the order it could send (`reach`), and
        # the reductions every rank could send go out as the ranks read the same round
        # (`release_through`); the units it did not run need no waiting (`not_run`).
        self.not_run = not_run
        self.reach = reach
        self._reported = 0  # the furthest position told, this backward
        self._releasing = False  # inside release_through: the paths are known already
        # Stages 2-3: a unit's reduced gradient is all in its fp32 shard (which is then in
        # memory, even when offloaded): the engine notes its norm before it leaves.
        self.on_grads_landed = on_grads_landed
        # Offloaded gradient shards held in memory while their parameters' reductions
        # land one by one: unit index -> parameters landed so far.
        self._landing: dict[int, int] = {}
        # Stage 3's order check: reductions go out only once the ranks' module paths so
        # far agree, and the last ones once the whole backward's do.
        self.before_reduction = before_reduction
        self.before_backward_end = before_backward_end
        self.on_memory = on_memory  # told after buffers are taken or given back
        self.stage = stage
        self.overlap = overlap
        # The dtype gradients are reduced in; None: each unit's compute dtype (an fp32
        # unit kept under bf16 compute reduces in fp32, `layout/fp32_params.py`).
        self.reduce_dtype = reduce_dtype
        self.on_unit_ready = on_unit_ready
        self.on_backward_end = on_backward_end
        self.sync = True
        self.in_flight = InFlightQueue()
        self._ready: dict[int, int] = {}  # unit index -> grads received this backward
        self._launched: set[int] = set()
        self._callback_queued = False
        self.pool = BufferPool()
        # The optimizer offloaded from an accelerator: reduced gradients copied to the
        # host shards without stalling backward.
        self.host_landings = HostLandings(self._add_landed, DIRECT_IN_FLIGHT_BYTES)
        self._written: dict[int, set[int]] = {}  # unit index -> slots written this window
        # A no_sync() backward ran since the last synchronised one: local sums may wait
        # in unit buffers (on some ranks only), so every rank reduces through them.
        self._local_sums = False
        # Units whose parameters this backward reduces one by one -> slots sent so far.
        self._direct: dict[int, set[int]] = {}
        self._trainable_count = {
            u.layout.index: sum(s.trainable for s in u.layout.slots) for u in units
        }
        # Reductions that pair with other ranks' go out in one order on every rank,
        # whatever path each rank's backward took; this backward's walk through it.
        self.order = ReductionOrder(
            [[s.trainable for s in u.layout.slots] for u in units],
            exchange if any(self._paired(u) for u in units) else None,
        )
        self._turns: Turns | None = None
        self._last_entry: dict[int, Entry] = {}  # unit reduced whole -> its last entry
        # This backward's small gradients packed together (`grad_buckets`).
        self.buckets = GradBuckets(on_memory)
        # Gradients of the latest synchronised backward that were ready before their turn
        # (0 when this rank's path matched the agreed order).
        self.waited_turns = 0
        self.hooks = GradHooks([(u.layout.slots, u.params) for u in units], self._on_hooked_grad)

    # ---------------------------------------------------------------- hooks
    def watch_outputs(self, output: Any) -> None:
        """Start a backward's bookkeeping when the first gradient reaches the model's
        outputs. That hook runs in the backward the user started, so the end-of-backward
        callback is queued on it; the first parameter's hook may run inside a nested
        backward (reentrant activation checkpointing recomputes a block and runs its
        backward inside the outer one), whose end is not the end of backward."""
        tensors = [
            t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if tensors:
            register_multi_grad_hook(tensors, lambda _grads: self.backward_started(), mode="any")

    def backward_started(self) -> None:
        """Queue the end-of-backward callback once per backward pass, and start its walk
        through the reduction order."""
        if not self._callback_queued:
            self._callback_queued = True
            for unit in self.units:  # (the first backward writes them first)
                unit.prepare_grads()
                if self.stage < 2 and unit.grad_full is not None:
                    unit.param_grads.show(unit.grad_full)  # hidden since zero_grad()
            queue_backward_callback(self._finish_backward)
            self._turns = self._start_turns() if self.sync else None
            if self.sync:
                self.waited_turns = 0

    @staticmethod
    def _paired(unit: FlatUnit) -> bool:
        """Whether the unit's reduction is a collective (other ranks hold its copy)."""
        return unit.layout.trainable and unit.group.holders.distributed

    def _start_turns(self) -> Turns:
        """This backward's walk through the reduction order: the parameters of the units
        reduced one by one, each its own turn; a unit reduced whole goes out at the turn
        of its last parameter in the order."""
        turns = self.order.turns(lambda entry: self._paired(self.units[entry[0]]))
        skipped = self.not_run()
        for entry in turns.entries if skipped else ():
            if entry[0] in skipped:
                turns.will_miss(entry)
        self._reported = 0
        self._last_entry = {}
        for unit_index, slot_index in turns.entries:
            if not self._would_reduce_directly(self.units[unit_index]):
                self._last_entry[unit_index] = (unit_index, slot_index)
        self.buckets.plan(
            turns.entries,
            [u.layout for u in self.units],
            self._reduce_dtype(self.units[0]).itemsize,
            lambda unit_index: unit_index not in self._last_entry,
        )
        return turns

    def _reduce_dtype(self, unit: FlatUnit) -> torch.dtype:
        return self.reduce_dtype or unit.compute_dtype

    def _on_hooked_grad(self, position: int, slot_index: int, p: nn.Parameter) -> None:
        self._on_grad(self.units[position], slot_index, p)

    def _on_grad(self, unit: FlatUnit, slot_index: int, p: nn.Parameter) -> None:
        slot = unit.layout.slots[slot_index]
        self.backward_started()
        grad = local_grad(p)  # a DTensor parameter's: its local shard
        if grad is None:
            return
        if self.stage < 2:
            view = unit.grad_full[slot.offset : slot.end].view(slot.shape)
            if grad.data_ptr() != view.data_ptr():  # .grad was reset to None
                view.copy_(grad)
                set_local_grad(p, view)
        elif self._reduces_directly(unit):
            del grad  # autograd's own tensor: reduced in place when nothing else holds it
            self._send_in_turn(unit, slot_index, local_grad(p))
            p.grad = None
        else:
            if unit.grad_full is None:
                unit.take_grad_buffer(
                    self.pool.take(unit.layout.padded_numel, unit.compute_dtype, unit.device)
                )
                self._written[unit.layout.index] = set()
                self.on_memory()
            written = self._written[unit.layout.index]
            target = unit.grad_full[slot.offset : slot.end]
            if slot_index in written:
                target.add_(grad.reshape(-1))
            else:  # first gradient of this window: no zero-fill pass needed
                target.copy_(grad.reshape(-1))
                written.add(slot_index)
            p.grad = None
        idx = unit.layout.index
        self.order.saw((idx, slot_index))
        self._ready[idx] = self._ready.get(idx, 0) + 1
        if self._ready[idx] == self._trainable_count[idx]:
            self.on_unit_ready(unit)
            if self.sync and self.overlap and idx not in self._direct and not self._paired(unit):
                self._launch(unit)
        if self.sync and self.overlap and idx not in self._direct:
            self._send_in_turn(unit, slot_index, None)

    def _send_in_turn(self, unit: FlatUnit, slot_index: int, grad: torch.Tensor | None) -> None:
        """A parameter's gradient is in (`grad`: to reduce on its own; None: written into
        its unit's buffer): send what the reduction order says is due. A reduction no
        other rank pairs with goes out at once."""
        if self._turns is None or not self._paired(unit):
            if grad is not None:
                self._launch_slot(unit, slot_index, grad)
            return
        entry = (unit.layout.index, slot_index)
        self._check_paths()  # (stage 3: the paths so far compared)
        hold = self.hold_reductions()
        due = self._turns.offer(entry, grad, hold=hold)
        if entry not in (e for e, _ in due):
            self.waited_turns += 1
        for turn, item in due:
            self._send_turn(turn, item)
        if hold:
            reachable = self._turns.reachable()
            if reachable > self._reported:
                self._reported = reachable
                self.reach(reachable)  # may release reductions, this one among them

    def release_through(self, position: int) -> None:
        """Stage 3, a pass whose paths differ: every rank, reading the same round, sends
        the reductions before `position` (each has every one of them, or none to give)."""
        if self._turns is None:
            return
        self._releasing = True
        try:
            for turn, item in self._turns.release(position):
                self._send_turn(turn, item)
        finally:
            self._releasing = False

    def _check_paths(self) -> None:
        if not self._releasing:
            self.before_reduction()

    def _send_turn(self, entry: Entry, item: object) -> None:
        """An entry's turn: its parameter's gradient reduced on its own (zeros if this
        rank produced none), or its unit reduced whole if this was the unit's last."""
        unit_index, slot_index = entry
        unit = self.units[unit_index]
        if self._last_entry.get(unit_index) == entry:
            self._launch(unit)
        elif unit_index not in self._last_entry:
            self._direct.setdefault(unit_index, set())
            bucket = self.buckets.pack(entry, item, self._reduce_dtype(unit), unit.device)
            if bucket is not None:
                self._direct[unit_index].add(slot_index)
                if bucket.complete:
                    self._reduce_bucket(unit, bucket)
                return
            if item is MISSING:  # what a rank with no gradient sends (`no_gradient`)
                slot = unit.layout.slots[slot_index]
                item = no_gradient(slot.numel, self._reduce_dtype(unit), unit.device)
            self._launch_slot(unit, slot_index, item)

    def _reduce_bucket(self, unit: FlatUnit, bucket: GradBucket) -> None:
        """A bucket's last gradient is in: reduce them together."""
        self._check_paths()
        sent = self.buckets.launch(bucket)
        if unit.group.grad_divisor > 1:
            sent.div_(unit.group.grad_divisor)
        self._send_parts(unit, sent, bucket.slots, bucket.starts, bucket.segments)

    def _finish_backward(self) -> None:
        self._callback_queued = False
        if self._turns is not None:  # (stage 3: the others may release them meanwhile)
            self._turns.miss_the_rest()
        self.before_backward_end()
        self._local_sums = not self.sync
        if self.sync:
            for entry, item in self._turns.rest() if self._turns is not None else ():
                self._send_turn(entry, item)
            for unit in self.units:  # the units no other rank pairs with
                if unit.layout.index in self._direct:
                    self._send_missing_slots(unit)
                elif unit.layout.trainable and unit.layout.index not in self._launched:
                    self._launch(unit)
            self.wait()
            self._launched.clear()
            self.order.agree()
            if self.stage < 2:
                self._hide_ungiven()
        self._turns = None
        self._direct.clear()
        self.buckets.forget()
        self._ready.clear()
        self.on_backward_end()

    def _hide_ungiven(self) -> None:
        """Stages 0-1, a synchronised backward's gradients in: a parameter whose `.grad`
        read None before these backwards and that no rank gave a gradient to (its reduced
        range all "no gradient") reads None again, as DDP leaves a globally unused
        parameter's `.grad` (one that read zeros keeps them). One host sync, after the
        reductions (`got_no_gradient`)."""
        shown = [
            (unit, index, piece)
            for unit in self.units
            if unit.grad_full is not None
            for index, piece in unit.param_grads.take_attached(unit.grad_full)
        ]
        for (unit, index, _), none in zip(shown, got_no_gradient([p for _, _, p in shown])):
            if none:
                unit.param_grads.hide_at(index)

    # ---------------------------------------------------------------- reduction
    def _reduces_directly(self, unit: FlatUnit) -> bool:
        """Whether this backward reduces `unit` parameter by parameter, straight from the
        gradients autograd produced: no unit-sized buffer, no copy into it. That needs a
        synchronised, overlapped backward, a reduction done in place (gloo's pairwise sends
        or all-reduce, or nothing to reduce over), and no `no_sync()` backward
        since the last synchronised one (its local sums wait in unit buffers, perhaps on
        some ranks only). Every input is the same on every rank, so the ranks choose alike
        and their collectives pair up. Decided at the unit's first gradient of the
        backward."""
        idx = unit.layout.index
        if idx in self._direct:
            return True
        if not self._would_reduce_directly(unit):
            return False
        self._direct[idx] = set()
        return True

    def _would_reduce_directly(self, unit: FlatUnit) -> bool:
        return (
            self.stage >= 2
            and self.sync
            and self.overlap
            and not self._local_sums
            and unit.group.comm.reduces_in_place
            and unit.group.exchange is None  # two hops reduce whole units
        )

    def _launch_slot(self, unit: FlatUnit, slot_index: int, grad: torch.Tensor) -> None:
        """Reduce one parameter's gradient over every rank holding its copy: over the shard
        group, each rank getting the sum of the part inside its shard; or, for replicated
        copies, all-reduced over them all (the full sum at once). This rank keeps the part
        inside its shard when it lands."""
        self._check_paths()
        self._direct[unit.layout.index].add(slot_index)
        group = unit.group
        # Autograd's own tensor is divided and reduced in place only when nothing else
        # holds its memory: .grad can be a view of a gradient backward still has to read.
        exclusive = _sole_owner(grad)
        flat, divisor = grad.reshape(-1), group.grad_divisor
        reduce_dtype = self._reduce_dtype(unit)
        if flat.dtype != reduce_dtype:  # converted first, as the unit buffers are
            sent = flat.to(reduce_dtype)
            if divisor > 1:
                sent.div_(divisor)
        elif exclusive or (divisor == 1 and group.holders.size == 1):
            sent = flat.div_(divisor) if divisor > 1 else flat
        elif divisor > 1:
            sent = torch.div(flat, divisor)
        else:
            sent = flat.clone()
        slot = unit.layout.slots[slot_index]
        self._send_parts(unit, sent, (slot_index,), (0,), ((slot.offset, slot.numel),))

    def _send_parts(
        self,
        unit: FlatUnit,
        sent: torch.Tensor,
        slots: tuple[int, ...],
        starts: tuple[int, ...],
        segments: tuple[tuple[int, int], ...],
    ) -> None:
        """Start reducing gradients of `unit` packed in `sent` (`segments` of its flat
        layout, one after another) over its shard group, or, for replicated copies, all
        of it over them all."""
        group = unit.group
        if group.summed_over_copies is None:
            work = group.comm.reduce_part(sent, unit.layout.shard_numel, True, segments)
        else:
            work = group.holders.all_reduce_sum(sent, async_op=True)
        self._push(InFlight(unit, work, sent, None, slots, starts))
        # Bound the gradients in flight by bytes: finish the oldest (never the newest).
        while len(self.in_flight) > 1 and self.in_flight.sent_bytes > DIRECT_IN_FLIGHT_BYTES:
            self._land(self.in_flight.pop())

    def _push(self, job: InFlight) -> None:
        # What it sends (unless that is the unit's gradient buffer itself, counted as
        # gradients) and, with pairwise sends, where the other ranks' parts land.
        self.in_flight.push(job, counted=self.stage >= 2 or job.sent is not job.unit.grad_full)
        self.on_memory()

    def _send_missing_slots(self, unit: FlatUnit) -> None:
        """End of backward: the unit's trainable parameters that got no gradient here are
        reduced with zeros, in slot order, so that every rank's collectives pair up."""
        sent = self._direct[unit.layout.index]
        for slot_index, slot in enumerate(unit.layout.slots):
            if slot.trainable and slot_index not in sent:
                none = no_gradient(slot.numel, self._reduce_dtype(unit), unit.device)
                self._launch_slot(unit, slot_index, none)

    def _launch(self, unit: FlatUnit) -> None:
        self._check_paths()
        self._launched.add(unit.layout.index)
        if unit.layout.numel == 0:
            return
        if self.stage >= 2:
            self._zero_unwritten(unit)
        sent = unit.grad_full
        reduce_dtype = self._reduce_dtype(unit)
        if sent.dtype != reduce_dtype:
            sent = self.pool.take(sent.numel(), reduce_dtype, sent.device).copy_(sent)
            self.on_memory()  # the converted copy and the buffer are both alive here
        group = unit.group
        if group.grad_divisor > 1:
            sent.div_(group.grad_divisor)  # average; dividing first keeps fp16 sums in range
        if self.stage < 2:
            out = sent
            work = group.holders.all_reduce_sum(sent, async_op=True)
        else:
            out, work = _start_reduce_scatter(
                group, sent, *unit.layout.shard_range(unit.rank), not unit.kept_fp32
            )
            buffer = unit.drop_grad_buffer()
            if sent is not buffer:
                self.pool.give(buffer)
        self._push(InFlight(unit, work, sent, out))
        # Bound the full-size buffers alive at once (stages 2-3): finish the oldest.
        while self.stage >= 2 and len(self.in_flight) > MAX_IN_FLIGHT:
            self._land(self.in_flight.pop())

    def _zero_unwritten(self, unit: FlatUnit) -> None:
        """Zero the parts of a pooled buffer no gradient was written to this window."""
        if unit.grad_full is None:  # no gradient reached this unit on this rank
            fill_no_gradient(
                unit.take_grad_buffer(
                    self.pool.take(unit.layout.padded_numel, unit.compute_dtype, unit.device)
                )
            )
            return
        written = self._written.pop(unit.layout.index, set())
        for slot_index, slot in enumerate(unit.layout.slots):
            if slot_index not in written:
                fill_no_gradient(unit.grad_full[slot.offset : slot.end])
        for start, end in unit.layout.padding():
            fill_no_gradient(unit.grad_full[start:end])

    def _land(self, job: InFlight) -> None:
        job.work.wait()
        unit = job.unit
        if job.slots:
            self._land_slots(job)
        elif self.stage < 2:
            if job.sent is not unit.grad_full:
                unit.grad_full.copy_(job.sent)
            mine = unit.grad_full[unit.opt_start : unit.opt_end]
            if unit.grad_opt.data_ptr() != mine.data_ptr():
                unit.grad_opt.copy_(mine)
        else:
            others = unit.group.summed_over_copies
            if others is not None:  # the other copies' sums of this shard
                others.all_reduce_sum(job.out)
            if unit.host != unit.device:
                self.host_landings.send(unit, job.out)
            else:
                self._add_landed(unit, job.out)
            self.pool.give(job.sent)  # (reused on the device after the copy to the host)
        self.on_memory()

    def _add_landed(self, unit: FlatUnit, reduced: torch.Tensor, at: int | None = None) -> None:
        """Add a unit's reduced gradient (this rank's part, where its shard is) into the
        shard, and let the engine note its norm; or (`at`) one parameter's part of it at
        that offset of a shard kept in memory."""
        if at is not None:
            unit.grad_opt[at : at + reduced.numel()].add_(reduced)
            return
        unit.bring_grads_in()
        try:
            unit.grad_opt.add_(reduced)
            self.on_grads_landed(unit)
        finally:
            unit.let_grads_go(modified=True)

    def _land_slots(self, job: InFlight) -> None:
        """Add the parts of the summed gradients (one parameter's, or a bucket's) inside
        this rank's shard to its fp32 slice."""
        unit = job.unit
        idx = unit.layout.index
        offloaded = unit.grad_home is not None
        if offloaded and idx not in self._landing:
            unit.bring_grads_in()  # until the unit's last parameter has landed
            self._landing[idx] = 0
        for slot_index, start in zip(job.slots, job.starts):
            slot = unit.layout.slots[slot_index]
            lo, hi = unit.mine_of(slot)
            if lo >= hi:
                continue
            part = job.sent[start + lo - slot.offset : start + hi - slot.offset]
            at = lo - unit.opt_start
            if unit.host != unit.device and not offloaded:
                self.host_landings.send(unit, part, at)  # without stalling backward
            else:
                self._add_landed(unit, to_host(part, unit), at)
        if offloaded:
            self._landing[idx] += len(job.slots)
            if self._landing[idx] == self._trainable_count[idx]:
                del self._landing[idx]
                try:
                    self.on_grads_landed(unit)
                finally:
                    unit.let_grads_go(modified=True)

    def wait(self) -> None:
        """Finish every reduction in flight and land the results in the fp32 slices."""
        while self.in_flight:
            self._land(self.in_flight.pop())
        self.host_landings.finish()

    def finish_sent(self) -> None:
        """Wait for the dense units' reductions in flight (each issued once every rank's
        module path agreed) to complete on the wire, without landing them: the engine is
        about to raise, and peers waiting on them get their data. Experts' reductions,
        outside that agreement, are not waited for."""
        for job in self.in_flight:
            if job.unit.group.spec.replicated:
                job.work.wait()

    def drop(self) -> None:
        """Let go of the reductions in flight without waiting (a peer is gone, or the
        process is ending after an error)."""
        self.in_flight.clear()
        self.host_landings.drop()
        self._direct.clear()
        self._turns = None
        self.buckets.forget()
        self._let_landing_go()

    def _let_landing_go(self) -> None:
        """Offloaded gradient shards a backward that stopped half way left in memory."""
        for idx in self._landing:
            self.units[idx].let_grads_go(modified=True)
        self._landing.clear()

    @property
    def holds_local_sums(self) -> bool:
        """A `no_sync()` backward ran since the last synchronised one (or full zero_grad)."""
        return self._local_sums

    def local_sums(self, unit: FlatUnit) -> list[int]:
        """Stages 2-3 under `no_sync()`: the slots of `unit` whose local (unreduced)
        gradient sums its full buffer holds so far."""
        if self.stage < 2 or unit.grad_full is None:
            return []
        return sorted(self._written.get(unit.layout.index, ()))

    def comm_buffers(self) -> list[torch.Tensor]:
        """Gradients being reduced, and where other ranks' parts land (the buffers being
        filled are the units')."""
        waiting = self.host_landings.tensors() + self._waiting_turn()
        return self.in_flight.tensors() + waiting + self.buckets.filling()

    def _waiting_turn(self) -> list[torch.Tensor]:
        """Gradients ready and waiting for their turn in the reduction order."""
        if self._turns is None:
            return []
        return [t for t in self._turns.waiting() if isinstance(t, torch.Tensor)]

    def pooled_buffers(self) -> list[torch.Tensor]:
        """Full-size gradient buffers kept idle for reuse."""
        return self.pool.tensors()

    def transient_bytes(self) -> tuple[int, int]:
        """(comm_buffers, pooled) as `memory_report` counts them, without walking every
        tensor: the reductions in flight, the unit buffers being filled (stages 2-3), and
        the pool. Cheap enough to run after every allocation."""
        filling = 0
        if self.stage >= 2:
            for idx in self._written:
                buf = self.units[idx].grad_full
                filling += 0 if buf is None else buf.nbytes
        waiting = sum(t.nbytes for t in self._waiting_turn())
        in_flight = self.in_flight.sent_bytes + self.buckets.filling_bytes
        return in_flight + filling + waiting, self.pool.free_bytes

    def zero_grad(self, set_to_none: bool = True, real_zeros: Sequence[torch.Tensor] = ()) -> None:
        """Forget every gradient. At stages 0-1 the buffers stay allocated and `.grad`
        reads None (`set_to_none`) or, as torch's, zeros where it was shown, until the
        next backward. `real_zeros` (stages 2-3): parts of the gradient shards that hold
        zeros afterwards, which the step takes as a gradient, not "no gradient"."""
        # A backward that raised half way left its per-backward state (its end-of-backward
        # callback never ran): finish what it sent and start the next one clean.
        self.wait()
        self._turns = None
        self._direct.clear()
        self.buckets.forget()
        self._ready.clear()
        self._launched.clear()
        self._callback_queued = False
        self._local_sums = False
        self._let_landing_go()
        for unit in self.units:
            unit.zero_grad_shard()
            if self.stage >= 2:
                buffer = unit.drop_grad_buffer()
                if buffer is not None:
                    self.pool.give(buffer)
                self._written.pop(unit.layout.index, None)
            elif unit.grad_full is not None:
                fill_no_gradient(unit.grad_full)
                if set_to_none:
                    unit.param_grads.hide()
                else:
                    unit.param_grads.zero_shown()
        for piece in real_zeros:  # (torch zeroes a .grad that exists, and steps it)
            piece.zero_()


def _start_reduce_scatter(group, sent: torch.Tensor, start: int, end: int, quantize_ok: bool):
    """Start summing a unit's whole gradient over its group; returns where this rank's
    part [start, end) lands (a slice of `sent` when reduced in place) and the work."""
    if group.exchange is not None:  # two hops: within the node, then across nodes
        out = torch.empty(end - start, dtype=sent.dtype, device=sent.device)
        return out, group.exchange.start_reduce_scatter(sent, out, quantize_ok)
    comm = group.comm
    if comm.reduces_in_place:
        out = sent[start:end]
    else:
        out = torch.empty(end - start, dtype=sent.dtype, device=sent.device)
    return out, comm.reduce_scatter_sum(sent, out, async_op=True)


def refuse_a_step_over_local_sums(stage: int, holds_local_sums: bool) -> None:
    """Stages 1-3: a step after a `no_sync()` backward with no synchronised backward since
    is refused. DDP would step each rank with its own sums and let the replicas drift
    apart; a sharded step has no such meaning (stage 1 would mix the ranks' sums shard by
    shard, stages 2-3 would see no gradient at all). Stage 0 steps as DDP does."""
    if stage >= 1 and holds_local_sums:
        raise RuntimeError(
            "optimizer.step() after a backward inside no_sync() with no synchronised "
            "backward since: those gradients were summed on each rank and never "
            f"reduced across ranks, and a ZeRO stage {stage} step takes only "
            "reduced ones. Run the last micro-batch's backward outside no_sync() "
            "(Accelerate: inside accumulate(); Fabric: "
            "no_backward_sync(enabled=False)), or call zero_grad() to drop them."
        )
