"""Full parameters and gradients on demand, for code written against DDP.

Stage 3 frees each unit's parameters between uses, and stages 2-3 keep only this rank's
slice of each gradient. Code that reads the model outside forward (an EMA callback, a
parity check, `model.a.item()`, a gradient dtype check after backward) would see empty
tensors or `None`. This module makes the full values visible where the caller asks, at a
cost the caller chooses:

- `FullParameters.gathered(modules, modifier_rank)`: the units holding those modules'
  parameters are gathered for a `with` block. Writes made inside it go back into the fp32
  masters (and the stage-3 shards) on exit: `modifier_rank`'s writes, broadcast first, or
  with `None` each rank's own slice of its own view (all ranks writing the same values
  is then exact). This is DeepSpeed's `GatheredParameters(modifier_rank=...)`, at every
  stage.
- `FullGrads`: `grad(param)` is one parameter's full reduced gradient (a collective over
  its unit's shard group); `show()` puts the full gradient on every `.grad`, as DDP does,
  for `ZeroConfig(keep_full_grads=True)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..layout.partition import ParamSlot
from ..tensor_parallel import MeshLayout, broadcast_whole_parameters, set_local_grad
from ..units.flat_unit import FlatUnit
from ..units.gather import STATE_DICT, GatherManager
from ..units.no_gradient import got_no_gradient
from .grad_face import GradFaces, GradReads


def units_of(
    units: list[FlatUnit], modules: nn.Module | Iterable[nn.Module] | None
) -> list[FlatUnit]:
    """The units holding any parameter of `modules` (all units when None)."""
    if modules is None:
        return list(units)
    if isinstance(modules, nn.Module):
        modules = [modules]
    wanted = {id(p) for m in modules for p in m.parameters()}
    return [u for u in units if any(id(p) in wanted for p in u.params)]


class FullParameters:
    """Installed by the engine with its units, its stage-3 gatherer (None at stages 0-2)
    and how to finish the parameter gathers of stages 1-2."""

    def __init__(
        self,
        units: list[FlatUnit],
        gather: GatherManager | None,
        wait_for_parameters: Callable[[], None],
        mesh: MeshLayout | None = None,
        tensor: Communicator | None = None,
        adopt_replaced: Callable[[FlatUnit], None] = lambda unit: None,
    ):
        self.units = units
        self.gather = gather
        self.wait_for_parameters = wait_for_parameters
        # What a `.data` replaced inside the block holds, taken before the unit is freed
        # (pruning made permanent, a lottery-ticket reset): `replaced_data.py`.
        self.adopt_replaced = adopt_replaced
        # Tensor parallelism: where a modifier rank sits, and the group whole parameters
        # are made equal over.
        self.mesh = mesh
        self.tensor = tensor

    @contextlib.contextmanager
    def gathered(
        self,
        modules: nn.Module | Iterable[nn.Module] | None = None,
        modifier_rank: int | None = None,
    ) -> Iterator[None]:
        """Full parameters of `modules` (every module when None) inside the block;
        collective on entry and exit (every rank holding them takes part)."""
        chosen = units_of(self.units, modules)
        self.wait_for_parameters()
        held = [u for u in chosen if self.gather is not None and self.gather.ensure(u, STATE_DICT)]
        try:
            yield
        finally:
            with torch.no_grad():
                for unit in chosen:
                    if unit.full is not None and unit.layout.numel:
                        self.adopt_replaced(unit)  # into the full buffer: broadcast next
                        unit.copies_to_full()
                        if modifier_rank is not None:
                            self._take_modifiers_values(unit, modifier_rank)
                            unit.full_to_copies()
                        write_back_unit(unit)
            for unit in held:
                unit.free_full()

    def _take_modifiers_values(self, unit: FlatUnit, rank: int) -> None:
        """`rank`'s writes win: over the data-parallel ranks, and with tensor
        parallelism at every position (the shards of the modifier's data-parallel index;
        the parameters whole on every position, its own)."""
        if self.mesh is None or self.tensor is None:
            _broadcast_from(unit, rank)
            return
        _broadcast_from(unit, self.mesh.peer_at_my_position(rank))
        position = self.mesh.position_of(rank)
        broadcast_whole_parameters(unit.full, unit.layout.slots, self.tensor, position, "gathered")


def _broadcast_from(unit: FlatUnit, rank: int) -> None:
    """Every holder of the unit's copy takes `rank`'s full values; a copy that `rank` does
    not hold (another expert-parallel rank's experts) keeps its own ranks' writes."""
    holders = unit.group.holders
    if rank in holders.group.ranks:
        holders.broadcast(unit.full, src=holders.group.ranks.index(rank), kind="gathered")


@torch.no_grad()
def write_back_unit(unit: FlatUnit) -> None:
    """This rank's slice of the (gathered) full values into its fp32 master and, at
    stage 3, its compute-dtype shard. In reduced precision only the elements that differ
    from the master's rounding are written, so reading alone never rounds a master."""
    write_back_part(unit, unit.opt_start, unit.full[unit.opt_start : unit.opt_end])


def write_back_part(unit: FlatUnit, lo: int, values: torch.Tensor) -> None:
    """`values` (the compute dtype) for flat elements [lo, lo + len) of this rank's
    slice into its master and stage-3 shard, as `write_back_unit` writes them."""
    local = slice(lo - unit.opt_start, lo - unit.opt_start + values.numel())
    with unit.master_resident(modified=True):  # offloaded: read, updated, written
        master = unit.master[local]
        if values.data_ptr() != master.data_ptr():
            if values.dtype == master.dtype:
                master.copy_(values)
            else:  # (the master may be in host memory: the comparison is made there)
                here = values.to(master.device)
                _put(master, here != master.to(values.dtype), here)
        if _shard_apart(unit):
            unit.shard[local].copy_(values)


@torch.no_grad()
def write_back_changes(unit: FlatUnit, before: torch.Tensor) -> torch.Tensor:
    """The elements of this rank's slice of the (gathered) full values that differ from
    `before` (what the gather put there) into its master and stage-3 shard: reading alone
    writes nothing, even where the gather was rounded (int8 over a slow link). Returns
    the slice as it is now (`before` itself when nothing changed)."""
    mine = unit.full[unit.opt_start : unit.opt_end]
    changed = mine != before
    if not bool(changed.any()):
        return before
    with unit.master_resident(modified=True):  # offloaded: read, updated, written
        _put(unit.master, changed, mine)
        if _shard_apart(unit):
            _put(unit.shard, changed, mine)
    return mine.clone()


def _put(target: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """target[where] = values[where], `target` on its own device (host memory when
    offloaded) and in its own dtype."""
    where = where.to(target.device)
    target[where] = values.to(target.device)[where].to(target.dtype)


def _shard_apart(unit: FlatUnit) -> bool:
    """Stage 3 keeps a compute-dtype shard besides the master (not one tensor: fp32)."""
    return unit.shard is not None and unit.shard.data_ptr() != unit.master.data_ptr()


class BackwardSums(Protocol):
    """What `FullGrads` reads of the gradient reducer: whether the last backward was
    synchronised, and which of a unit's slots this rank has summed locally."""

    sync: bool

    def local_sums(self, unit: FlatUnit) -> list[int]: ...


class FullGrads:
    """Full gradients for readers: one parameter's on request, or all of them on `.grad`
    after each synchronised backward (`show`), kept consistent with clipping and
    unscaling (`scale`, `clamp`) until the next backward or step (`hide`).

    Stages 0-1 hold the full reduced gradient on `.grad` already; stages 2-3 gather it
    from the shards into a full buffer per unit (the compute dtype: DDP's gradient
    memory), and at stage 3 also keep the parameters gathered while it is shown."""

    def __init__(
        self,
        units: list[FlatUnit],
        stage: int,
        gather: GatherManager | None,
        owner: dict[int, tuple[FlatUnit, ParamSlot]],
        reads: GradReads,
    ):
        """`owner`: id(parameter) -> (its unit, its slot), the engine's map. `reads`:
        what the sharded `.grad` faces (shown at stages 2-3 unless full gradients are
        kept) ask of the engine."""
        self.faces = GradFaces(units, reads)
        self.units = units
        self.stage = stage
        self.gather = gather
        self._shown: dict[int, torch.Tensor] = {}  # unit index -> full gradient buffer
        self._held: list[FlatUnit] = []  # stage 3: units gathered to carry .grad
        self.owner = owner

    def grad(self, param: torch.Tensor, scale: float = 1.0) -> torch.Tensor | None:
        """`param`'s full reduced gradient in fp32 (None for a frozen parameter), divided
        by `scale` (the loss scale not yet taken out). Collective over its unit's shard
        group at stages 2-3."""
        if id(param) not in self.owner:
            raise ValueError(
                "full_grad() takes a parameter of the engine's model (model.parameters()); "
                f"got a tensor of shape {tuple(param.shape)} it does not manage."
            )
        unit, slot = self.owner[id(param)]
        if not slot.trainable or unit.grad_opt is None:
            return None
        full = self._gather(unit, unit.master_dtype)
        value = full[slot.offset : slot.end].view(slot.shape).clone()
        return value / scale if scale != 1.0 else value

    def grads_of(self, module: nn.Module, scale: float = 1.0) -> dict[str, torch.Tensor]:
        """Every trainable parameter's full reduced gradient in `module`, by its name in
        the module; one gather per unit (collective over each unit's shard group)."""
        fulls: dict[int, torch.Tensor] = {}
        out = {}
        for name, param in module.named_parameters():
            unit, slot = self.owner[id(param)]
            if not slot.trainable or unit.grad_opt is None:
                continue
            if unit.layout.index not in fulls:
                fulls[unit.layout.index] = self._gather(unit, unit.master_dtype)
            value = fulls[unit.layout.index][slot.offset : slot.end].view(slot.shape).clone()
            out[name] = value / scale if scale != 1.0 else value
        return out

    def _gather(self, unit: FlatUnit, dtype: torch.dtype) -> torch.Tensor:
        if self.stage < 2:
            return unit.grad_full.to(dtype)
        full = torch.empty(unit.layout.padded_numel, dtype=dtype, device=unit.device)
        with unit.grads_resident():  # read back when offloaded
            unit.group.comm.all_gather(full, unit.grad_opt.to(full.device, dtype))
        return full

    # ---------------------------------------------------------------- on .grad
    def show(self, full: bool) -> None:
        """After a synchronised backward (stages 2-3; stages 0-1 have `.grad` already):
        every trainable parameter's `.grad` is its sharded face (`grad_face`), or with
        `full` a view of its unit's full reduced gradient, gathered (DDP's memory)."""
        if self.stage < 2:
            return
        if not full:
            self.faces.show()
            return
        for unit in self.units:
            if not unit.layout.trainable or not unit.layout.numel:
                continue
            if self.gather is not None and self.gather.ensure(unit, STATE_DICT):
                self._held.append(unit)
            full = self._gather(unit, unit.compute_dtype)
            self._shown[unit.layout.index] = full
            shown = [(s, p) for s, p in zip(unit.layout.slots, unit.params) if s.trainable]
            grads = [full[s.offset : s.end] for s, _ in shown]
            for (slot, p), grad, none in zip(shown, grads, got_no_gradient(grads)):
                if not none or slot.tensor_sharded:  # (no rank used it: None, as DDP)
                    set_local_grad(p, grad.view(slot.shape))

    def show_after_backward(self, reducer: BackwardSums, full: bool) -> None:
        """`.grad` after a backward: the reduced gradients (`show`), or after a
        `no_sync()` one this rank's own sums (`show_local`), as DDP shows them."""
        if reducer.sync:
            self.show(full)
        else:
            self.show_local(reducer.local_sums)

    def _parts(self, groups: set[int] | None) -> list[torch.Tensor]:
        """The shown gradients of every param group, or of `groups`."""
        if groups is None:
            return list(self._shown.values())
        return [
            self._shown[unit.layout.index][seg.start : seg.end]
            for unit in self.units
            if unit.layout.index in self._shown
            for seg in unit.layout.segments(0, unit.layout.numel, groups)
        ]

    def show_local(self, local_sums: Callable[[FlatUnit], list[int]]) -> None:
        """After a `no_sync()` backward (stages 2-3): `.grad` is this rank's own
        accumulated gradient, as DDP shows it before synchronising, a view of the full
        buffer that holds it (`local_sums(unit)`: its slots written so far). At stage 3
        the parameters need not be gathered: a freed one keeps its shape."""
        for unit in self.units:
            slots = local_sums(unit)
            if not slots:
                continue
            self._shown[unit.layout.index] = unit.grad_full
            for i in slots:
                slot = unit.layout.slots[i]
                set_local_grad(
                    unit.params[i], unit.grad_full[slot.offset : slot.end].view(slot.shape)
                )

    def changed(self) -> None:
        """The engine changed the gradient shards (a clip, an unscale, a zeroing)."""
        self.faces.reads.changed()

    def scale(self, factor: float, groups: set[int] | None = None) -> None:
        for grad in self._parts(groups):
            grad.mul_(factor)

    def clamp(self, limit: float, groups: set[int] | None = None) -> None:
        for grad in self._parts(groups):
            grad.clamp_(-limit, limit)

    def cleared(self) -> set[int]:
        """The param groups whose sharded `.grad` user code set to None (a zero_grad that
        bypassed the engine)."""
        return self.faces.cleared()

    def hide(self, faces: bool = True, groups: set[int] | None = None) -> None:
        """Before the next backward, or when the step changes the parameters: the shown
        gradients go (a later backward would otherwise accumulate into them). With
        `faces=False` the sharded faces stay: they read the shards, which stay valid until
        the next backward or zero_grad (an evaluation forward or a step leaves them).
        With `groups` (one optimizer's `zero_grad()` of several) only the `.grad` of the
        parameters in them go; the buffers stay for the others'."""
        if groups is not None:
            self.faces.hide(groups)
            for unit in self.units:
                if unit.layout.index in self._shown:
                    for slot, p in zip(unit.layout.slots, unit.params):
                        if slot.trainable and not groups.isdisjoint(slot.groups):
                            p.grad = None
            return
        if faces:
            self.faces.hide()
        if not self._shown and not self._held:
            return
        for unit in self.units:
            if unit.layout.index in self._shown:
                for slot, p in zip(unit.layout.slots, unit.params):
                    if slot.trainable:
                        p.grad = None
        self._shown.clear()
        for unit in self._held:
            if not unit.persistent:
                unit.free_full()
        self._held.clear()
