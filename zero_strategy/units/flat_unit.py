"""The tensors of one unit on one rank: flat parameters, shard, fp32 master, gradients.

Which of them exist, and which are views of which, depends on the stage:

============  ===============================  ===================  =====================
stage         compute-dtype parameters         fp32 master          gradient (fp32 view)
============  ===============================  ===================  =====================
0             full buffer, persistent          = full if fp32       full buffer (in place)
1             full buffer, persistent          = my slice if fp32   full buffer (in place)
2             full buffer, persistent          = my slice if fp32   my slice only
3             my slice; full only when in use  = my slice if fp32   my slice only
============  ===============================  ===================  =====================

"my slice" is the range the optimizer steps on this rank: the rank's shard (its position
in the unit's shard group) at stages 1-3, everything at stage 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import nn

from ..comm.topology import ShardGroup
from ..layout.partition import ParamSlot, UnitLayout
from ..private_api import in_backward
from ..tensor_parallel import (
    SHARD_INSIDE_A_STORAGE_COMPILES,
    is_dtensor,
    local_tensor,
    match_local_dtype,
    on_storage_of_its_own,
)
from .no_gradient import fill_no_gradient, no_gradient
from .param_grads import ParamGradViews
from .storage_pool import StoragePool


class ShardHome(Protocol):
    """Where a stage-3 shard lives between uses (offload_params="disk"), or a master
    that is a tensor of its own (offload_optimizer="disk")."""

    def acquire(self, unit: FlatUnit) -> None: ...
    def release(self, unit: FlatUnit, modified: bool = False) -> None: ...
    def prefetch(self, unit: FlatUnit) -> None: ...


class GradHome(Protocol):
    """Where a unit's fp32 gradient shard lives between its reduction and the step
    (stages 2-3 with offload_optimizer="disk")."""

    def acquire(self, unit: FlatUnit) -> None: ...
    def release(self, unit: FlatUnit, modified: bool = False) -> None: ...
    def prefetch(self, unit: FlatUnit) -> None: ...
    def change(self, unit: FlatUnit, change: Callable[[], None]) -> None: ...
    def forget(self, unit: FlatUnit) -> None: ...


class FlatUnit:
    def __init__(
        self,
        layout: UnitLayout,
        params: list[nn.Parameter],
        stage: int,
        group: ShardGroup,
        device: torch.device,
        compute_dtype: torch.dtype,
        host: torch.device | None = None,
        pin: bool = False,
        shard_device: torch.device | None = None,
    ):
        self.layout = layout
        self.params = params  # aligned with layout.slots
        self.stage = stage
        self.group = group  # who shards, reduces and gathers this unit
        self.rank = group.rank if stage else 0  # this rank's slice of the layout
        self.device = device
        # Where the optimizer's side lives (the fp32 master and gradient shard, and so the
        # optimizer's state): the training device, or host memory when the optimizer is
        # offloaded from an accelerator (`pin`: page-locked, for asynchronous copies).
        self.host = device if host is None else host
        self.pin = pin
        # Stage 3: where the compute-dtype shard lives between gathers (the training
        # device, or with offload_params from an accelerator the host: copied over for
        # each gather).
        self.shard_device = device if shard_device is None else shard_device
        self._copied_back: torch.cuda.Event | None = None  # pinned: the last copy out
        self.compute_dtype = compute_dtype
        # The optimizer's dtype: fp32, or fp64 for fp64 compute (never below compute).
        self.master_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        self.opt_start, self.opt_end = (
            (0, layout.padded_numel) if stage == 0 else layout.shard_range(self.rank)
        )
        self.full: torch.Tensor | None = None  # compute dtype, padded_numel
        self.shard: torch.Tensor | None = None  # stage 3: compute dtype, shard_numel
        self.master: torch.Tensor | None = None  # master dtype over [opt_start, opt_end)
        self._grad_full: torch.Tensor | None = None  # compute dtype, padded_numel
        self._grad_opt: torch.Tensor | None = None  # master dtype over [opt_start, opt_end)
        self._grads_untouched = False  # its memory taken, not yet written (`grad_opt`)
        self.param_grads = ParamGradViews(layout.slots, params)  # stages 0-1: `.grad` views
        self._persistent = stage < 3  # stage 3: the scheduler's residency rule
        self._empty = torch.empty(0, dtype=compute_dtype, device=device)
        # Stage 3: what each freed parameter shows, made once (`_free_storage_views`).
        nan = torch.full((), float("nan"), dtype=compute_dtype, device=device)
        self._placeholders = [nan.expand(slot.shape) for slot in layout.slots]
        self.on_freed: Callable[[FlatUnit], None] | None = None  # told at each stage-3 free
        self._buf: torch.Tensor | None = None  # stage 3 gather buffer
        # Stage 3 with a two-hop exchange: this rank's column of the across-node hop, kept
        # from a training forward to the unit's backward (`start_gather`).
        self._secondary: torch.Tensor | None = None
        # Stage 3: DTensor parameters' copies of their values, by slot (`_own_copy`).
        self._copies: dict[int, torch.Tensor] = {}
        self._pool: StoragePool | None = None  # stage 3: recycles gather memory
        # Stage 3 with offload_params="disk": the shard is in memory only while in use.
        self._home: ShardHome | None = None
        # offload_optimizer="disk" with the master a tensor of its own: the master likewise
        # (then `home` keeps the compute copy alone).
        self._master_home: ShardHome | None = None
        # Stages 2-3 with offload_optimizer="disk": the gradient shard likewise.
        self._grad_home: GradHome | None = None

    # ------------------------------------------------------------------ who decides what
    # The unit's fields are its own: the parts that decide where its tensors live and
    # for how long say so through these calls, and read the fields through properties.
    @property
    def kept_fp32(self) -> bool:
        """Parameters kept in fp32 under bf16/fp16 compute (`layout/fp32_params.py`): for
        their precision, never quantized on the way either."""
        return self.layout.compute_dtype is not None

    @property
    def persistent(self) -> bool:
        """Whether the unit stays gathered between uses (stages 0-2 always; stage 3 the
        units under `persistence_threshold`)."""
        return self._persistent

    def set_residency(self, persistent: bool, pool: StoragePool | None) -> None:
        """Stage 3's scheduler: keep the unit gathered, or free it after each use into
        `pool` (gather memory recycled between units of one size)."""
        self._persistent = persistent
        self._pool = pool

    @property
    def home(self) -> ShardHome | None:
        return self._home

    @property
    def master_home(self) -> ShardHome | None:
        return self._master_home

    @property
    def grad_home(self) -> GradHome | None:
        return self._grad_home

    def keep_shard_in(self, home: ShardHome) -> None:
        """Stage 3's parameter shard (and the master, unless it has a home of its own)
        lives in `home` between uses."""
        self._home = home

    def keep_master_in(self, home: ShardHome) -> None:
        """The fp32 master lives in `home` between the steps and writes that use it."""
        self._master_home = home

    def keep_grads_in(self, home: GradHome) -> None:
        """The fp32 gradient shard lives in `home` between its reduction and the step."""
        self._grad_home = home

    @property
    def grad_full(self) -> torch.Tensor | None:
        """The full-size gradient buffer: `.grad`'s memory at stages 0-1; at stages 2-3
        the buffer a backward fills until its reduction is sent (or no_sync's local sums)."""
        return self._grad_full

    def take_grad_buffer(self, buffer: torch.Tensor) -> torch.Tensor:
        """Stages 2-3: the reducer hands the unit a full-size buffer to fill."""
        self._grad_full = buffer
        return buffer

    def drop_grad_buffer(self) -> torch.Tensor | None:
        """Stages 2-3: the buffer goes back to the reducer (sent, or zeroed away)."""
        buffer, self._grad_full = self._grad_full, None
        return buffer

    # ------------------------------------------------------------------ set-up
    def install(self, full_values: torch.Tensor) -> None:
        """Take this unit's initial values (the full flat buffer in the master dtype,
        identical on every rank) and build the persistent tensors from it."""
        lay = self.layout
        apart = self.master_apart
        if self.stage < 3:
            self.full = full_values.to(self.compute_dtype)
            my = self.full[self.opt_start : self.opt_end]
            self.master = self._on_host(full_values[self.opt_start : self.opt_end]) if apart else my
            self._point_params_at(self.full)
        else:
            start, end = lay.shard_range(self.rank)
            mine = full_values[start:end]
            self.master = self._on_host(mine)
            self.shard = self.master
            if apart:
                self.shard = torch.empty(
                    end - start,
                    dtype=self.compute_dtype,
                    device=self.shard_device,
                    pin_memory=self.pin and self.shard_device != self.device,
                ).copy_(mine)
            self._free_storage_views()
        self.grad_opt = None
        if self.stage < 2 and lay.trainable:
            self._grad_full = no_gradient(lay.padded_numel, self.compute_dtype, self.device)
            if not apart:
                self.grad_opt = self.grad_full[self.opt_start : self.opt_end]
        if self._grad_opt is None and lay.trainable:
            # Taken, not written: a host rank's pages stay unused until training fills
            # them (a freshly built engine, pretrained weights loading into it).
            self._grad_opt = self._on_host(None, fill=False)
            self._grads_untouched = True

    def gather_input(self, target: torch.Tensor) -> torch.Tensor:
        """Stage 3: this rank's shard on the training device, as the input of its gather
        into `target`. A shard that lives on the host is copied straight into its place
        in `target` (gathered in place from there): from page-locked memory the copy does
        not wait, and the shard's next writer waits for it."""
        if self.shard_device == self.device:
            return self.shard
        n = self.shard.numel()
        place = target[self.rank * n : (self.rank + 1) * n]
        place.copy_(self.shard, non_blocking=self.pin)
        self._note_copy()
        return place

    def _note_copy(self) -> None:
        """After an asynchronous copy between this unit's host memory and the device: an
        event on the device's stream, for `wait_for_copies_back`."""
        if self.pin:
            self._copied_back = torch.cuda.Event()
            self._copied_back.record(torch.cuda.current_stream(self.device))

    def _on_host(self, values: torch.Tensor | None, fill: bool = True) -> torch.Tensor:
        """A tensor of the optimizer's side (master dtype, this rank's slice, on `host`):
        a copy of `values`, or the no-gradient mark (or, without `fill`, unwritten)."""
        out = torch.empty(
            self.opt_end - self.opt_start,
            dtype=self.master_dtype,
            device=self.host,
            pin_memory=self.pin,
        )
        if values is not None:
            return out.copy_(values)
        return fill_no_gradient(out) if fill else out

    # ------------------------------------------------------------------ gradient shard
    @property
    def grad_opt(self) -> torch.Tensor | None:
        """The fp32 gradient shard. It is written (the no-gradient mark) at its first
        use, not when the unit is built: until then its host pages are not touched, so
        a freshly built engine (and pretrained weights loading into it) holds none."""
        if self._grads_untouched:
            self.prepare_grads()
        return self._grad_opt

    @grad_opt.setter
    def grad_opt(self, value: torch.Tensor | None) -> None:
        self._grad_opt = value
        self._grads_untouched = False

    @property
    def grad_opt_untouched(self) -> torch.Tensor | None:
        """The gradient shard as it is, unwritten or not: to make views of it (the
        optimizer's) and to count its bytes, neither of which reads it."""
        return self._grad_opt

    def prepare_grads(self) -> None:
        """Write the gradient shard's first values, if nothing has yet."""
        if self._grads_untouched:
            self._grads_untouched = False
            fill_no_gradient(self._grad_opt)

    @property
    def locals(self) -> list[torch.Tensor]:
        """What holds each parameter's values on this rank, whose memory the unit
        provides: the parameter, or a DTensor parameter's local shard (tensor
        parallelism). Looked up each time: a module conversion (`.to()`) swaps a DTensor's
        contents, local shard included."""
        return [local_tensor(p) for p in self.params]

    def _point_params_at(self, flat: torch.Tensor) -> None:
        for index in range(len(self.params)):
            self.point_param_at(index, flat)

    def point_param_at(self, index: int, flat: torch.Tensor | None = None) -> None:
        """Parameter `index` shows its values in `flat` (the full buffer by default).
        Under torch 2.13 a DTensor's local shard gets a storage that starts at its first
        element, which its torch.compile needs (`on_storage_of_its_own`): at stages 0-2
        the same memory, at stage 3 a copy (`_own_copy`); from 2.14 it is a slice of the
        buffer, as a plain parameter is."""
        slot, p = self.layout.slots[index], self.params[index]
        values = (self.full if flat is None else flat)[slot.offset : slot.end].view(slot.shape)
        if is_dtensor(p) and not SHARD_INSIDE_A_STORAGE_COMPILES:
            values = (
                self._own_copy(index, values) if self.stage >= 3 else on_storage_of_its_own(values)
            )
        local_tensor(p).data = values
        match_local_dtype(p)

    def _own_copy(self, index: int, values: torch.Tensor) -> torch.Tensor:
        """Stage 3: a slice of the gather buffer would keep the address the buffer had
        when it was made, and the buffer moves at each gather; so a DTensor parameter
        gets a copy of its own (FSDP2's copy-out), one storage for the unit's life, grown
        at each gather and freed with the buffer: tensors autograd saved in forward
        (weight.t()) see its values again when it is refilled for backward."""
        copy = self._copies.get(index)
        if copy is None:
            copy = self._copies[index] = torch.empty_like(values)
        else:
            copy.untyped_storage().resize_(values.numel() * values.element_size())
        return copy.copy_(values)

    @torch.no_grad()
    def copies_to_full(self) -> None:
        """Stage 3, gathered: what was written to DTensor parameters' own copies, back
        into the full buffer (before it is written back to the masters or broadcast)."""
        if self.full is None:
            return
        for index, copy in self._copies.items():
            slot = self.layout.slots[index]
            self.full[slot.offset : slot.end].copy_(copy.reshape(-1))

    @torch.no_grad()
    def full_to_copies(self) -> None:
        """Stage 3, gathered: the full buffer was written (a broadcast, a gather again):
        the DTensor parameters' own copies take its values."""
        if self.full is None:
            return
        for index, copy in self._copies.items():
            slot = self.layout.slots[index]
            copy.copy_(self.full[slot.offset : slot.end].view(slot.shape))

    def replaced(self) -> dict[int, torch.Tensor]:
        """Parameters whose `.data` code outside the engine replaced since the unit last
        pointed them (its build, a gather, a free): index -> the tensor holding their
        values now (`param.data = values`: a lottery-ticket reset, a weight pinned by
        hand). A zero-size parameter has nothing to replace."""
        found = {}
        for index, (slot, local) in enumerate(zip(self.layout.slots, self.locals)):
            if slot.end != slot.offset and local.data_ptr() != self._shown_at(index):
                found[index] = local.detach()  # the written memory, not the parameter
        return found

    def _shown_at(self, index: int) -> int:
        """The address parameter `index` shows its values at: its slice of the full
        buffer, its own copy (a DTensor at stage 3), or the freed placeholder."""
        if self.full is None:
            return self._placeholders[index].data_ptr()
        copy = self._copies.get(index)
        if copy is not None and self.stage >= 3:
            return copy.data_ptr()
        offset = self.layout.slots[index].offset
        return self.full.data_ptr() + offset * self.full.element_size()

    @property
    def gathering(self) -> bool:
        """Stage 3: a gather into the buffer is in flight (its memory taken, the
        parameters not yet pointed at it)."""
        return (
            self.full is None and self._buf is not None and self._buf.untyped_storage().nbytes() > 0
        )

    def show_freed(self, index: int) -> None:
        """Stage 3, not gathered: parameter `index` shows the freed placeholder again."""
        local_tensor(self.params[index]).data = self._placeholders[index]
        match_local_dtype(self.params[index])

    def show_own(self, index: int) -> None:
        """Parameter `index` shows the unit's memory again: its slice of the full buffer
        where the unit is whole, else (stage 3) the freed placeholder."""
        if self.full is not None:
            self.point_param_at(index)
        else:
            self.show_freed(index)

    def _free_storage_views(self) -> None:
        """Stage 3: a freed parameter keeps its own shape, numel, dtype and device (what
        summaries, `.grad` assignment and shape checks read) over one shared NaN element:
        any value read from it is NaN, never a plausible number, and a write raises
        (every element aliases one memory location)."""
        for index in range(len(self.params)):
            self.show_freed(index)
        for copy in self._copies.values():
            copy.untyped_storage().resize_(0)
        if self.on_freed is not None:
            self.on_freed(self)

    def grad_buffers(self) -> list[torch.Tensor]:
        """Every distinct gradient tensor of this unit, each element once: scaling or
        clipping them all keeps `.grad` (stages 0-1) and the optimizer's slice in step."""
        if self.grad_opt is None:
            return []
        if self.grad_full is None or self.stage >= 2:
            return [self.grad_opt]
        if (
            self.grad_opt.untyped_storage().data_ptr()
            == self.grad_full.untyped_storage().data_ptr()
        ):
            return [self.grad_full]  # the optimizer's slice is a view of it
        return [self.grad_full, self.grad_opt]

    # ------------------------------------------------------------------ stage 3
    def bring_in(self) -> None:
        """The shard (master and compute copy) is needed: in memory until `let_go`."""
        if self._home is not None:
            self._home.acquire(self)

    def let_go(self, modified: bool = False) -> None:
        """One use of the shard is over (`modified`: it changed and must be kept)."""
        if self._home is not None:
            self._home.release(self, modified)

    @contextlib.contextmanager
    def resident(self, modified: bool = False) -> Iterator[None]:
        """The shard in memory inside the block."""
        self.bring_in()
        try:
            yield
        finally:
            self.let_go(modified)

    def prefetch(self) -> None:
        """The shard will be needed soon: start reading it if it is offloaded."""
        if self._home is not None:
            self._home.prefetch(self)

    # ------------------------------------------------------------------ master
    @property
    def master_apart(self) -> bool:
        """Whether the master is a tensor of its own (mixed precision, or the optimizer
        offloaded from an accelerator) rather than the compute copy or a view of it."""
        compute_on = self.shard_device if self.stage == 3 else self.device
        return self.compute_dtype != self.master_dtype or self.host != compute_on

    @property
    def master_offloaded(self) -> bool:
        return self._master_home is not None or self._home is not None

    def bring_master_in(self) -> None:
        """The master and the compute copy this rank holds are needed (the step, a
        checkpoint, a write of the weights): in memory until `let_master_go`."""
        self.wait_for_copies_back()  # the master may be written in there
        if self._home is not None:
            self._home.acquire(self)
        if self._master_home is not None:
            try:
                self._master_home.acquire(self)
            except BaseException:
                self.let_go()
                raise

    def let_master_go(self, modified: bool = False) -> None:
        """One use is over (`modified`: the master or the compute copy changed)."""
        if self._master_home is not None:
            self._master_home.release(self, modified)
        if self._home is not None:
            self._home.release(self, modified)

    @contextlib.contextmanager
    def master_resident(self, modified: bool = False) -> Iterator[None]:
        """The master (and the compute copy) in memory inside the block."""
        self.bring_master_in()
        try:
            yield
        finally:
            self.let_master_go(modified)

    def prefetch_master(self) -> None:
        self.prefetch()
        if self._master_home is not None:
            self._master_home.prefetch(self)

    # ------------------------------------------------------------------ gradient shard
    def bring_grads_in(self) -> None:
        """The fp32 gradient shard (`grad_opt`) is needed: in memory until `let_grads_go`."""
        if self._grad_home is not None:
            self._grad_home.acquire(self)

    def let_grads_go(self, modified: bool = False) -> None:
        if self._grad_home is not None:
            self._grad_home.release(self, modified)

    @contextlib.contextmanager
    def grads_resident(self, modified: bool = False) -> Iterator[None]:
        """The gradient shard in memory inside the block."""
        self.bring_grads_in()
        try:
            yield
        finally:
            self.let_grads_go(modified)

    def prefetch_grads(self) -> None:
        if self._grad_home is not None:
            self._grad_home.prefetch(self)

    def change_grads(self, change: Callable[[], None]) -> None:
        """Run `change` on views of `grad_opt` (a scale, a clamp, a zeroing), now, or with
        the shard offloaded when it is next in memory."""
        if self._grad_home is not None:
            self._grad_home.change(self, change)
        else:
            change()

    def zero_grad_shard(self) -> None:
        if self._grad_home is not None:
            self._grad_home.forget(self)
        elif self.grad_opt is not None:
            fill_no_gradient(self.grad_opt)

    @property
    def gathered(self) -> bool:
        return self.full is not None

    def mine_of(self, slot: ParamSlot) -> tuple[int, int]:
        """[lo, hi) of `slot` inside this rank's slice, in the unit's flat coordinates
        (lo >= hi: none of it is here)."""
        return max(slot.offset, self.opt_start), min(slot.end, self.opt_end)

    def gather_target(self) -> torch.Tensor:
        """The buffer to all-gather into. It is always the same storage, grown back to
        full size: tensors autograd saved in forward (views such as weight.t()) point at
        it, and come back to life when it is refilled before backward."""
        if self._buf is None:
            self._buf = torch.empty(
                self.layout.padded_numel, dtype=self.compute_dtype, device=self.device
            )
            return self._buf
        nbytes = self.layout.padded_numel * self._empty.element_size()
        storage = self._buf.untyped_storage()
        if self._pool is not None:
            self._pool.fill(storage, nbytes)
        elif storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        return self._buf

    # ------------------------------------------------------------------ made whole
    # One act at every stage, asked for by the schedule: stage 3 gathers a unit into its
    # gather buffer for a use and frees it after; stages 1-2 keep it whole and gather the
    # updated shards back after each step.
    def start_gather(self, fresh: bool = False):
        """Stage 3: start the asynchronous all-gather of this unit into its gather buffer
        (an offloaded shard is in memory until `finish_gather`); returns the work.

        With a two-hop exchange, a column kept from this pass's forward spares the
        across-node hop (unless `fresh`: every rank then does both hops, as when the
        ranks' module paths differ), and a training forward keeps its column."""
        target = self.gather_target()
        self.bring_in()
        shard = self.gather_input(target)  # on the device (copied in, when on the host)
        exchange = self.group.exchange
        if exchange is None:
            return self.group.comm.all_gather(target, shard, async_op=True)
        kept = None if fresh else self._secondary
        work, column = exchange.start_gather(target, shard, kept, not self.kept_fp32)
        keep = (
            exchange.keeps_secondary and not fresh and torch.is_grad_enabled() and not in_backward()
        )
        self._secondary = column if keep else None
        return work

    def drop_secondary(self) -> None:
        """The pass is over, or the shard changed: the kept column is stale."""
        self._secondary = None

    def start_gather_for_others(self) -> tuple[object, torch.Tensor]:
        """Stage 3: take part in a gather that only other ranks asked for, into a buffer
        of its own (the unit may be gathered here and in use); returns the work and the
        buffer, dropped once the work is done (then `let_go`)."""
        target = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype, device=self.device)
        self.bring_in()
        shard = self.gather_input(target)
        exchange = self.group.exchange
        if exchange is not None:
            return exchange.start_gather(target, shard, None, not self.kept_fp32)[0], target
        return self.group.comm.all_gather(target, shard, async_op=True), target

    def finish_gather(self, work) -> None:
        """Stage 3: the gather `start_gather` began is done; the parameters point at the
        whole buffer."""
        work.wait()
        self.let_go()
        self.expose_full()

    def regather(self) -> None:
        """Stage 3, a unit kept gathered: gather its updated shard again, now."""
        with self.resident():
            self.group.comm.all_gather(self.full, self.gather_input(self.full))
        self.full_to_copies()

    def start_publish(self):
        """Stages 1-2: start gathering every rank's updated slice back into the whole
        buffer the parameters view; returns the work."""
        return self.group.comm.all_gather(
            self.full, self.full[self.opt_start : self.opt_end], async_op=True
        )

    def expose_full(self) -> None:
        """The gather finished: point the module's parameters at the full buffer."""
        self.full = self._buf
        self._point_params_at(self.full)

    def free_full(self) -> None:
        """Give the gathered memory back; parameters become empty tensors, so a stray use
        is a shape error rather than a read of freed memory."""
        if self.full is None:
            return
        self._free_storage_views()
        if self._pool is not None:
            self._pool.drain(self._buf.untyped_storage())
        else:
            self._buf.untyped_storage().resize_(0)
        self.full = None

    def gathered_bytes(self) -> int:
        """Stage 3: bytes of the gathered parameters, and of a kept column."""
        if self._buf is None or self.stage < 3:
            return 0
        kept = (
            0
            if self._secondary is None
            else self._secondary.numel() * self._secondary.element_size()
        )
        return kept + sum(storage.nbytes() for storage in self.gathered_storages())

    def gathered_storages(self) -> list[torch.UntypedStorage]:
        """Stage 3: the gather buffer's memory and the DTensor parameters' own copies
        (empty while the unit is freed)."""
        copies = [copy.untyped_storage() for copy in self._copies.values()]
        return [self._buf.untyped_storage(), *copies]

    # ------------------------------------------------------------------ after the step
    def sync_compute_from_master(self, lo: int = 0, hi: int | None = None) -> None:
        """Write the updated fp32 master (elements [lo, hi) of this rank's slice) into the
        compute-dtype copy this rank holds."""
        if not self.master_apart:
            return  # the compute copy is the master
        # The master is only read; the compute copy, offloaded or not, is written. From
        # page-locked host memory the copy to the device does not wait: the device runs it
        # before the next forward's kernels. Whatever writes the master next waits for it
        # (`wait_for_copies_back`).
        with self.master_resident(), self.resident(modified=True):
            compute = self.full[self.opt_start : self.opt_end] if self.stage < 3 else self.shard
            compute[lo:hi].copy_(self.master[lo:hi], non_blocking=self.pin)
            if compute.device != self.master.device:
                self._note_copy()

    def wait_for_copies_back(self) -> None:
        """Before the master is written: the last asynchronous copy out of it is done."""
        if self._copied_back is not None:
            self._copied_back.synchronize()
            self._copied_back = None


class OneResident:
    """Keeps one unit's master (and compute copy), or its gradient shard, in memory at a
    time, for walks over pieces in unit order (a checkpoint's, the step's): each unit is
    read once, not once per piece."""

    def __init__(self, modified: bool = False, grads: bool = False):
        self.modified = modified
        self.grads = grads  # the gradient shard rather than the master
        self.unit: FlatUnit | None = None

    def __call__(self, unit: FlatUnit) -> FlatUnit:
        if unit is not self.unit:
            self.close()
            if self.grads:
                unit.bring_grads_in()
            else:
                unit.bring_master_in()
            self.unit = unit
        return unit

    def close(self) -> None:
        if self.unit is not None:
            unit, self.unit = self.unit, None
            if self.grads:
                unit.let_grads_go(self.modified)
            else:
                unit.let_master_go(self.modified)

    def __enter__(self) -> OneResident:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
