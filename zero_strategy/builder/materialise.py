"""Builder step 6: every unit's initial values, agreed over its shard group.

A model built on the meta device is initialised here (its modules' own initialisers, or
the user's `param_init_fn`), one unit at a time at stage 3, so no rank ever holds more
than one unit whole. A model built with real tensors gives its values. Either way every
rank of a unit's group starts from the group's first rank's values (and a unit with
several copies from the first copy's), as DDP starts every rank from rank 0's.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layout.shard_spec import owner_of
from ..tensor_parallel import broadcast_whole_parameters, whole_for_init
from ..units.flat_unit import FlatUnit
from . import meta_init


def materialise(
    model: nn.Module,
    units: list[FlatUnit],
    stage: int,
    device: torch.device,
    tensor_group,
    init_fn: meta_init.InitFn | None,
    params: list,
) -> meta_init.AwaitedBuffers:
    """Give every unit its values, then run the buffers' initialisers of a meta model.
    Returns the persistent buffers that no initialiser filled, which a load must fill
    (`meta_init.awaiting_load`)."""
    on_meta = meta_init.has_meta_params(model)
    recomputed: list[str] = []
    if on_meta:
        meta_init.detach_from_meta([p.param for p in params], device)
        recomputed = meta_init.detach_meta_buffers(model, device, init_fn)
    _materialise_units(model, units, on_meta, init_fn, stage, device, tensor_group)
    if on_meta:
        owners = meta_init.buffer_owners(model, recomputed)
        meta_init.run_init(model, owners, init_fn, keep=set())
        return meta_init.awaiting_load(model, recomputed)
    return meta_init.AwaitedBuffers(model)


def _materialise_units(model, units, on_meta, init_fn, stage, device, tensor_group) -> None:
    def flat_for(unit: FlatUnit) -> torch.Tensor:
        return torch.zeros(unit.layout.padded_numel, dtype=unit.master_dtype, device=device)

    def agree(unit: FlatUnit, flat: torch.Tensor) -> None:
        unit.group.comm.broadcast(flat, src=0)
        if unit.group.summed_over_copies is not None:  # every copy starts from copy 0's
            unit.group.summed_over_copies.broadcast(flat, src=0)
        if tensor_group is not None:  # whole parameters: position 0's values
            broadcast_whole_parameters(flat, unit.layout.slots, tensor_group, src=0)

    if on_meta and stage < 3:
        flats = [flat_for(u) for u in units]
        for unit, flat in zip(units, flats):
            _point(unit, flat)
        slots = [s for u in units for s in u.layout.slots]
        owners = meta_init.owner_modules(model, slots)
        targets = [t for u, f in zip(units, flats) for t in _sharded_targets(u, f)]
        if not targets:
            meta_init.run_init(model, owners, init_fn)
        # Tensor-sharded parameters are initialised whole: one module's at a time.
        for path, module in owners if targets else ():
            mine = [t for t in targets if owner_of(t[0][0]) == path]
            with whole_for_init(model, mine):
                meta_init.run_init(model, [(path, module)], init_fn)
        for unit, flat in zip(units, flats):
            agree(unit, flat)
            unit.install(flat)
        return
    for unit in units:
        flat = flat_for(unit)
        if on_meta:
            _point(unit, flat)
            owners = meta_init.owner_modules(model, unit.layout.slots)
            names = {n for s in unit.layout.slots for n in (s.name, *s.aliases)}
            with whole_for_init(model, _sharded_targets(unit, flat)):
                meta_init.run_init(model, owners, init_fn, keep=names)
        else:
            _copy_in(unit, flat)
        agree(unit, flat)
        unit.install(flat)
        del flat


def _point(unit: FlatUnit, flat: torch.Tensor) -> None:
    for slot, local in zip(unit.layout.slots, unit.locals):
        local.data = flat[slot.offset : slot.end].view(slot.shape)


def _copy_in(unit: FlatUnit, flat: torch.Tensor) -> None:
    for slot, local in zip(unit.layout.slots, unit.locals):
        flat[slot.offset : slot.end].copy_(local.detach().reshape(-1))


def _sharded_targets(unit: FlatUnit, flat: torch.Tensor):
    return [
        ((s.name, *s.aliases), s.tensor, flat[s.offset : s.end])
        for s in unit.layout.slots
        if s.tensor_sharded
    ]
