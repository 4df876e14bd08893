"""Stage 3: a parameter read by name outside its unit's use is gathered first.

At stage 3 a unit's parameters hold no values between uses (a NaN placeholder with their
shape). Code written against DDP reads them there all the same: `self.layer.weight.item()`
in a test_step that runs no forward, `torch.equal(a.weight, b.weight)` in on_fit_start,
a weight logged in on_train_batch_end, a pruning callback ranking weights between epochs.
FSDP2's parameters are DTensors there, and an op on one runs the collective it needs.
Here each module owning such a parameter becomes its own subclass (as `fully_shard`
re-classes a module, keeping the class's name) whose attribute read gathers the unit
first. The unit then stays whole until its next use frees it (its forward in evaluation,
the end of the next backward, a framework's evaluation step), or a step; writes made to
it meanwhile are kept, as under DDP: the elements of each rank's slice that differ from
what the gather put there go into its master when the unit is freed, and before a step,
a save or a state dict reads the masters. `print(model)` gathers nothing: a repr reads
shapes, which the placeholders keep.

A read is collective over the unit's shard group: every rank must read, as every rank
must read a DTensor; a read on one rank alone is caught by the divergence check (or the
collective timeout). Reads of a unit already whole, inside backward, or inside a compiled
region cost a dictionary lookup. Iterating `model.parameters()` goes around attribute
access and still sees the placeholders: `engine.unshard()` or `gathered_parameters()`
gather those. The model's root module is not re-classed (a LightningModule's class is
what its checkpoints and hooks are looked up by); its own parameters are whole inside a
step.
"""

from __future__ import annotations

import copyreg
import threading
from collections.abc import Callable

import torch
from torch import nn

from ..private_api import in_backward
from ..units.flat_unit import FlatUnit
from ..units.gather import WrittenValues
from .full_view import write_back_changes

_FACE = "_zero_parameter_reads"
_QUIET = threading.local()  # reads that show metadata only (a repr) gather nothing


class _Face:
    """What a re-classed module's attribute reads consult: which of its attribute names
    are parameters of which unit, and who gathers one."""

    def __init__(self, units: dict[str, FlatUnit], read: Callable[[FlatUnit], None]):
        self.units = units
        self.read = read


class _GathersOnRead:
    """Placed before the module's own class: reading a parameter of a freed unit
    gathers the unit, then returns the parameter as the class would."""

    def __getattr__(self, name: str):
        value = super().__getattr__(name)  # type: ignore[misc]
        if torch.compiler.is_compiling() or getattr(_QUIET, "on", False):
            return value
        face = self.__dict__.get(_FACE)
        if face is not None:
            unit = face.units.get(name)
            if unit is not None and not unit.gathered:
                face.read(unit)
        return value

    def extra_repr(self) -> str:
        """`print(model)` (often on rank 0 alone) reads shapes, which the placeholders
        keep: no gather."""
        _QUIET.on = True
        try:
            return super().extra_repr()  # type: ignore[misc]
        finally:
            _QUIET.on = False

    def __reduce_ex__(self, protocol):
        """Deep-copied (an EMA copy, an averaged model) as the module's own class, without
        the face: the copy is a plain module, whose reads never gather."""
        _, _, state, *rest = super().__reduce_ex__(protocol)
        if isinstance(state, dict) and _FACE in state:
            state = {k: v for k, v in state.items() if k != _FACE}
        plain = _PLAIN[type(self)]
        return (copyreg._reconstructor, (plain, object, None), state, *rest)


_CLASSES: dict[type, type] = {}  # module class -> its reading class
_PLAIN: dict[type, type] = {}  # and back


def _reading_class(cls: type) -> type:
    """`cls` with reads that gather, one class per module class, under the same name (what
    summaries, reprs and messages print)."""
    made = _CLASSES.get(cls)
    if made is None:
        made = type(cls)(cls.__name__, (_GathersOnRead, cls), {"__module__": cls.__module__})
        made.__qualname__ = cls.__qualname__
        _CLASSES[cls], _PLAIN[made] = made, cls
    return made


class _Reclassed:
    """A handle (as the engine's hooks have) that gives the module its own class back,
    unless something re-classed it since."""

    def __init__(self, module: nn.Module, cls: type):
        self.module, self.cls = module, cls

    def remove(self) -> None:
        if type(self.module) is _CLASSES.get(self.cls):
            self.module.__class__ = self.cls
        self.module.__dict__.pop(_FACE, None)


class ParameterReads:
    """Stage 3's gather-on-read faces, and the `WrittenValues` the gather schedule sees:
    `inner`'s (replaced `.data`), plus the in-place writes to units a read gathered."""

    def __init__(self, inner: WrittenValues):
        self._inner = inner
        self._gather: Callable[[FlatUnit], None] | None = None
        # Units a read found freed (or in flight), not yet freed again: this rank's slice
        # as gathered, so that only what code writes goes back into the master (never the
        # rounding of a quantized gather, or of the compute dtype).
        self.held: dict[int, tuple[FlatUnit, torch.Tensor]] = {}

    def install(
        self, model: nn.Module, units: list[FlatUnit], gather: Callable[[FlatUnit], None]
    ) -> list[_Reclassed]:
        """Re-class each submodule that owns a parameter of a unit freed between uses;
        `gather(unit)` makes it whole. Returns the handles that undo it."""
        self._gather = gather
        owned: dict[str, dict[str, FlatUnit]] = {}
        for unit in units:
            if unit.persistent or not unit.layout.numel:
                continue
            for slot in unit.layout.slots:
                for name in (slot.name, *slot.aliases):
                    path, _, attribute = name.rpartition(".")
                    if path:
                        owned.setdefault(path, {})[attribute] = unit
        handles = []
        for path, names in owned.items():
            module = model.get_submodule(path)
            cls = type(module)
            if isinstance(module, torch.jit.ScriptModule) or _FACE in module.__dict__:
                continue
            module.__dict__[_FACE] = _Face(names, self._read)
            module.__class__ = _reading_class(cls)
            handles.append(_Reclassed(module, cls))
        return handles

    def _read(self, unit: FlatUnit) -> None:
        if in_backward() or self._gather is None:
            return
        self._gather(unit)
        if unit.gathered:
            with torch.no_grad():
                unit.copies_to_full()
                mine = unit.full[unit.opt_start : unit.opt_end].clone()
            self.held[unit.layout.index] = (unit, mine)

    def write_back(self) -> None:
        """What code wrote to the units a read gathered, into the masters now (a save, a
        state dict, an EMA update reads them); the units stay whole."""
        for index, (unit, before) in list(self.held.items()):
            self.held[index] = (unit, self._write_back(unit, before))

    @staticmethod
    def _write_back(unit: FlatUnit, before: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            unit.copies_to_full()  # DTensor parameters' own copies
        after = write_back_changes(unit, before)
        if after is not before:  # a kept across-node column is stale once anything changed
            unit.drop_secondary()
        return after

    def drop_unwritten(self) -> None:
        """The masters changed (a step, a load): what a read gathered holds old values,
        to be freed without writing them back."""
        self.held.clear()

    # ------------------------------------------------------------ WrittenValues
    def taken(self, unit: FlatUnit) -> dict[int, torch.Tensor]:
        return self._inner.taken(unit)

    def adopt_unit(self, unit: FlatUnit, written: dict[int, torch.Tensor] | None = None) -> None:
        """Before a free (`written` None): a unit a read gathered keeps what was written
        to it in place, then `inner` adopts replaced `.data`."""
        held = self.held.pop(unit.layout.index, None) if written is None else None
        if held is not None:
            self._write_back(unit, held[1])
        self._inner.adopt_unit(unit, written)
