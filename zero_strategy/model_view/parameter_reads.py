"""Stage 3: a parameter read by name outside its unit's use is gathered when its values are.

At stage 3 a unit's parameters hold no values between uses (a NaN placeholder with their
shape). Code written against DDP reads them there all the same: `self.layer.weight.item()`
in a test_step that runs no forward, `torch.equal(a.weight, b.weight)` in on_fit_start,
a weight logged in on_train_batch_end, a pruning callback ranking weights between epochs.
FSDP2's parameters are DTensors there, and an op on one runs the collective it needs,
while its shape, dtype and device are read locally. Here each module owning such a
parameter becomes its own subclass (as `fully_shard` re-classes a module, keeping the
class's name) whose attribute read hands out the parameter marked: a tensor subclass for
as long as its unit stays freed, whose metadata (shape, dtype, device, `.grad`, flags)
reads as the placeholder's, and whose first op that needs values (`.data`, arithmetic,
`.item()`, a copy) gathers the unit. So `model.fc.weight.shape` on rank 0 alone is
local, as it is under DDP and FSDP2, and `print(model)` gathers nothing. The unit then
stays whole until its next use frees it (its forward in evaluation, the end of the next
backward, a framework's evaluation step), or a step; writes made to it meanwhile are
kept, as under DDP: the elements of each rank's slice that differ from what the gather
put there go into its master when the unit is freed, and before a step, a save or a
state dict reads the masters.

A value read is collective over the unit's shard group: every rank must read, as every
rank must read a DTensor's values; a value read on one rank alone is caught by the
divergence check (or the collective timeout). Reads of a unit already whole, inside
backward, or inside a compiled region cost a dictionary lookup. Iterating
`model.parameters()` goes around attribute access and still sees the placeholders:
`engine.unshard()` or `gathered_parameters()` gather those. The model's root module is
not re-classed (a LightningModule's class is what its checkpoints and hooks are looked up
by); its own parameters are whole inside a step.
"""

from __future__ import annotations

import copyreg
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..private_api import in_backward
from ..units.flat_unit import FlatUnit
from ..units.gather import WrittenValues
from .full_view import write_back_changes

_FACE = "_zero_parameter_reads"

# What a freed parameter answers from its placeholder: what it is, not what it holds.
_METADATA_ATTRIBUTES = frozenset(
    {
        "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "ndim", "layout",
        "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn",
        "is_nested", "names", "grad_fn", "name", "output_nr", "_version", "itemsize",
        "nbytes", "_grad", "_grad_fn", "_backward_hooks", "_post_accumulate_grad_hooks",
    }
)  # fmt: skip
_METADATA_METHODS = frozenset(
    {
        "size", "dim", "numel", "nelement", "element_size", "is_floating_point",
        "is_complex", "is_contiguous", "stride", "storage_offset", "data_ptr",
        "get_device", "untyped_storage", "__len__", "__hash__", "requires_grad_",
        "register_hook", "register_post_accumulate_grad_hook", "retain_grad",
        "is_pinned", "is_shared",
    }
)  # fmt: skip


class _Face:
    """What a re-classed module's attribute reads consult: which of its attribute names
    are parameters of which unit, and who marks (or gathers) one."""

    def __init__(self, units: dict[str, FlatUnit], read: Callable[[FlatUnit, Any], None]):
        self.units = units
        self.read = read


class _GathersOnRead:
    """Placed before the module's own class: a parameter of a freed unit is handed out
    marked, to gather the unit at its first op that needs values."""

    def __getattr__(self, name: str):
        value = super().__getattr__(name)  # type: ignore[misc]
        if torch.compiler.is_compiling():
            return value
        face = self.__dict__.get(_FACE)
        if face is not None:
            unit = face.units.get(name)
            if unit is not None and not unit.gathered:
                face.read(unit, value)
        return value

    def __reduce_ex__(self, protocol):
        """Deep-copied (an EMA copy, an averaged model) as the module's own class, without
        the face: the copy is a plain module, whose reads never gather."""
        _, _, state, *rest = super().__reduce_ex__(protocol)
        if isinstance(state, dict) and _FACE in state:
            state = {k: v for k, v in state.items() if k != _FACE}
        plain = _PLAIN[type(self)]
        return (copyreg._reconstructor, (plain, object, None), state, *rest)


def _needs_values(func: Any) -> bool:
    """Whether a torch function on a freed parameter reads (or writes) its values: every
    op but the metadata reads above and the attribute setters (`.data = t`, `.grad = g`,
    which the engine's watch of replaced `.data` and its gradient face handle)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") not in (
            _METADATA_ATTRIBUTES
        )
    return name not in _METADATA_METHODS and name not in ("__set__", "__delete__")


class _ValuesOnUse(nn.Parameter):
    """A parameter handed out by a read while its unit is freed: the first op that needs
    its values gathers the unit (and turns it, and every parameter of the unit so marked,
    back into a plain `nn.Parameter`)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _needs_values(func):
            for leaf in tree_leaves((args, kwargs)):
                if type(leaf) is _ValuesOnUse:
                    _gather_for_use(leaf)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        """A plain parameter holding the values (gathered), as DDP's deep copy holds."""
        if id(self) not in memo:
            values = self.data.clone(memory_format=torch.preserve_format)
            memo[id(self)] = nn.Parameter(values, self.requires_grad)
        return memo[id(self)]


# id(parameter) -> (the parameter, who gathers its unit, the unit), while marked
_MARKED: dict[int, tuple[nn.Parameter, ParameterReads, FlatUnit]] = {}


def _gather_for_use(param: nn.Parameter) -> None:
    entry = _MARKED.get(id(param))
    if entry is None or entry[0] is not param:  # a copy made while marked: plain
        param.__class__ = nn.Parameter
        return
    _, reads, unit = entry
    if in_backward() or torch.compiler.is_compiling():
        return  # backward gathers what it needs itself; the placeholder reads NaN
    if not unit.gathered:
        reads.gather_read(unit)  # restores the marks of the unit's parameters
    reads.unmark(unit)


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


class _Unmarking:
    """A handle whose removal turns the parameters still marked back into plain ones."""

    def __init__(self, reads: ParameterReads):
        self.reads = reads

    def remove(self) -> None:
        self.reads.unmark()


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
    ) -> list[_Reclassed | _Unmarking]:
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
        return [*handles, _Unmarking(self)]

    def _read(self, unit: FlatUnit, value: Any) -> None:
        """A module's attribute read found `value`, a parameter of the freed `unit`: a
        plain parameter is marked, to gather at its first op that needs values; another
        kind (a quantized or sharded subclass) gathers now."""
        if in_backward() or self._gather is None:
            return
        if type(value) is nn.Parameter:
            _MARKED[id(value)] = (value, self, unit)
            value.__class__ = _ValuesOnUse
        elif type(value) is not _ValuesOnUse:
            self.gather_read(unit)

    def gather_read(self, unit: FlatUnit) -> None:
        """Gather `unit` for a read of its values, keeping this rank's slice as gathered."""
        if self._gather is None:
            return
        self._gather(unit)
        if unit.gathered:
            with torch.no_grad():
                unit.copies_to_full()
                mine = unit.full[unit.opt_start : unit.opt_end].clone()
            self.held[unit.layout.index] = (unit, mine)

    def unmark(self, unit: FlatUnit | None = None) -> None:
        """The parameters of `unit` (of every unit when None) marked by a read are plain
        again: a gather pointed them at values, or the engine lets go of the model."""
        for key, (param, reads, owner) in list(_MARKED.items()):
            if reads is self and (unit is None or owner is unit):
                del _MARKED[key]
                if type(param) is _ValuesOnUse:
                    param.__class__ = nn.Parameter

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
        """Before a gather points the unit's parameters at values: those a read marked
        are plain again (an op in forward costs nothing extra)."""
        self.unmark(unit)
        return self._inner.taken(unit)

    def adopt_unit(self, unit: FlatUnit, written: dict[int, torch.Tensor] | None = None) -> None:
        """Before a free (`written` None): a unit a read gathered keeps what was written
        to it in place, then `inner` adopts replaced `.data`."""
        held = self.held.pop(unit.layout.index, None) if written is None else None
        if held is not None:
            self._write_back(unit, held[1])
        self._inner.adopt_unit(unit, written)
