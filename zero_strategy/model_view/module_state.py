"""`model.state_dict()` and `model.load_state_dict()` keep their meaning on a sharded model.

Stage 3 frees each unit's parameters between uses, so a plain `state_dict()` would hand out
empty tensors and `load_state_dict()` would fail on shape, or (stages 1-2 in reduced
precision) write values the next step overwrites from the fp32 masters. Hooks on every
module that owns parameters fix both:

- stage 3: the unit is gathered for the call, the entries are copies of the full values,
  and the unit is freed again. The gather is a collective, so every rank makes the call,
  as with FSDP's full state dict (`engine.full_state_dict()` gathers the fp32 masters,
  unit by unit, onto rank 0 instead);
- a load writes the values into this rank's shard and its fp32 master, so the next step
  starts from them;
- stages 1-2: reads and loads first wait for the parameter gathers still in flight after
  a step, and a load refreshes the fp32 masters.

Hooks on each unit's own module gather it once for all the modules inside it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..layout.partition import ParamSlot
from ..private_api import direct_parameters
from ..tensor_parallel import local_tensor
from ..units.flat_unit import FlatUnit
from ..units.gather import STATE_DICT, GatherManager
from ..units.module_hooks import EngineHook


class ModuleStateHooks:
    """Installed by the engine, which hands over its units, its stage-3 gatherer (None
    at stages 0-2) and how to wait for the parameter gathers of stages 1-2."""

    def __init__(
        self,
        model: nn.Module,
        units: list[FlatUnit],
        gather: GatherManager | None,
        wait_for_parameters: Callable[[], None],
    ):
        self.gather = gather
        self.wait_for_parameters = wait_for_parameters
        self.owner: dict[int, tuple[FlatUnit, ParamSlot]] = {
            id(p): (unit, slot) for unit in units for slot, p in zip(unit.layout.slots, unit.params)
        }
        self._held: dict[int, list[FlatUnit]] = {}  # module id -> units it gathered
        self._loading: dict[int, dict[str, torch.Tensor]] = {}  # module id -> its entries
        self.handles = []
        # A module's units (two where its parameters are partly frozen), gathered first.
        unit_modules: dict[str, list[FlatUnit]] = {}
        for unit in units:
            if unit.layout.module_path is not None:
                unit_modules.setdefault(unit.layout.module_path, []).append(unit)
        for name, module in model.named_modules():
            own = self._own_units(module)
            if name in unit_modules:
                first = unit_modules[name]
                own = [*first, *(u for u in own if all(u is not f for f in first))]
            if not own:
                continue
            self.handles += [
                module.register_state_dict_pre_hook(EngineHook(self._make_pre(own))),
                module.register_state_dict_post_hook(EngineHook(self._make_save())),
                module.register_load_state_dict_pre_hook(EngineHook(self._make_load_pre(own))),
                module.register_load_state_dict_post_hook(EngineHook(self._make_load_post())),
            ]

    def _own_units(self, module: nn.Module) -> list[FlatUnit]:
        units: dict[int, FlatUnit] = {}
        for p in direct_parameters(module).values():
            if p is not None and id(p) in self.owner:
                unit = self.owner[id(p)][0]
                units[unit.layout.index] = unit
        return list(units.values())

    # ---------------------------------------------------------------- gathering
    def _acquire(self, module: nn.Module, units: list[FlatUnit]) -> None:
        self.wait_for_parameters()
        if self.gather is None:
            return
        held = [unit for unit in units if self.gather.ensure(unit, STATE_DICT)]
        if held:
            self._held.setdefault(id(module), []).extend(held)

    def _release(self, module: nn.Module) -> None:
        for unit in self._held.pop(id(module), []):
            unit.free_full()

    def _make_pre(self, units: list[FlatUnit]):
        def hook(module, prefix, keep_vars):
            self._acquire(module, units)

        return hook

    def _make_load_pre(self, units: list[FlatUnit]):
        def hook(module, state_dict, prefix, *args):
            self._acquire(module, units)
            # The entries this call loads, kept to write them into the fp32 masters at
            # full precision (not through a bf16 parameter) and to leave the rest alone.
            self._loading[id(module)] = {
                name: state_dict[prefix + name]
                for name in direct_parameters(module)
                if prefix + name in state_dict
            }

        return hook

    # ---------------------------------------------------------------- per module
    # (torch marks hooks with attributes, so each registration gets its own function)
    def _make_save(self):
        def hook(module, destination, prefix, local_metadata):
            self._save_own(module, destination, prefix)

        return hook

    def _make_load_post(self):
        def hook(module, incompatible_keys):
            self._load_own(module)

        return hook

    def _direct_params(self, module: nn.Module):
        for name, p in direct_parameters(module).items():
            if p is not None and id(p) in self.owner:
                yield name, p, *self.owner[id(p)]

    def _save_own(self, module, destination, prefix) -> None:
        if self.gather is not None:
            for name, p, _, _ in self._direct_params(module):
                key = prefix + name
                if key in destination and not isinstance(destination[key], nn.Parameter):
                    # A copy (the gather buffer is reused), in CPU memory: every rank makes
                    # this call, and the full model would not fit each device.
                    destination[key] = p.detach().to("cpu", copy=True)
        self._release(module)

    @torch.no_grad()
    def _load_own(self, module) -> None:
        loaded = self._loading.pop(id(module), {})
        for name, _, unit, slot in self._direct_params(module):
            if name in loaded:
                write_back(unit, slot, loaded[name])
        self._release(module)


def write_back(unit: FlatUnit, slot: ParamSlot, source: torch.Tensor) -> None:
    """The slot was just loaded from `source`: copy this rank's part into its fp32 master
    (and at stage 3 its compute-dtype shard). A source that is not the parameter's values
    one for one (a module that converts on load) is read back from the loaded parameter."""
    lo, hi = unit.mine_of(slot)
    if lo >= hi or unit.master is None:
        return
    source = local_tensor(source)  # a DTensor's values on this rank: its local shard
    if source.numel() == slot.numel:
        values = source.detach().reshape(-1)[lo - slot.offset : hi - slot.offset]
    elif unit.full is not None:
        unit.copies_to_full()
        values = unit.full[lo:hi]
    else:
        return
    local = slice(lo - unit.opt_start, hi - unit.opt_start)
    with unit.master_resident(modified=True):  # offloaded: read, updated, written
        master = unit.master[local]
        if master.data_ptr() != values.data_ptr():
            master.copy_(values)
        if unit.shard is not None and unit.shard.data_ptr() != unit.master.data_ptr():
            unit.shard[local].copy_(values)
