"""Stage 3: a parameter's values read outside its unit's use gather the unit first.

At stage 3 a unit's parameters hold no values between uses (a NaN placeholder with their
shape). Code written against DDP reads them there all the same: `self.layer.weight.item()`
in a test_step that runs no forward, `torch.equal(a.weight, b.weight)` in on_fit_start,
an EMA kept by hand over `model.parameters()`, a pruning callback ranking weights between
epochs. FSDP2's parameters are DTensors there: an op on one runs the collective it needs,
while its shape, dtype and device are read locally. Here a freed unit's parameters are
marked (an `nn.Parameter` subclass, `_ValuesOnUse`, until the unit is next gathered):
their metadata (shape, dtype, device, `.grad`, flags) reads the placeholder's, locally,
and the first op that needs values (`.data`, arithmetic, `.item()`, a copy) gathers the
unit. So `model.fc.weight.shape` on rank 0 alone is local, as under DDP and FSDP2, and
`print(model)` gathers nothing. The forward's gather makes them plain again, so neither
the forward nor a compiled graph sees the subclass. A unit gathered by a read stays whole
until its next use frees it (its forward in evaluation, the end of the next backward, a
framework's evaluation step), or a step; writes made to it meanwhile are kept, as under
DDP: the elements of each rank's slice that differ from what the gather put there go into
its master when the unit is freed, and before a step, a save or a state dict reads the
masters.

A value read is collective over the unit's shard group: every rank must read, as every
rank must read a DTensor's values; one rank alone is caught by the divergence check (or
the collective timeout). Inside a forward the read is that forward's use of the unit
(the gather decides: `GatherManager.gather_for_read`), so a module that reads another's
weight (`nn.MultiheadAttention`, its `out_proj`'s) on a path some ranks skip is merged
with their gathers as a skipped module's is. Reads inside backward or a compiled region
see the placeholder. Parameters of another tensor class (a DTensor under tensor
parallelism) cannot be marked: the module owning one is re-classed instead (as
`fully_shard` re-classes a module, under the class's own name), and its attribute read of
such a parameter gathers the unit.
"""

from __future__ import annotations

import copyreg
import weakref
from collections.abc import Callable
from dataclasses import dataclass
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
    are parameters of which unit, and who gathers one."""

    def __init__(self, units: dict[str, FlatUnit], read: Callable[[FlatUnit], None]):
        self.units = units
        self.read = read


class _GathersOnRead:
    """Placed before the module's own class: reading a parameter (of a class that cannot
    be marked) of a freed unit gathers the unit."""

    def __getattr__(self, name: str):
        value = super().__getattr__(name)  # type: ignore[misc]
        if torch.compiler.is_compiling():
            return value
        face = self.__dict__.get(_FACE)
        if face is not None:
            unit = face.units.get(name)
            if unit is not None and not unit.gathered:
                face.read(unit)
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
    """A parameter of a freed unit: the first op that needs its values gathers the unit
    (and turns the unit's parameters back into plain `nn.Parameter`s)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _needs_values(func):
            for leaf in tree_leaves((args, kwargs)):
                if type(leaf) is _ValuesOnUse:
                    _gather_for_use(leaf)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __repr__(self, *, tensor_contents=None) -> str:
        """Local, as a DTensor's repr is: a print on rank 0 alone (a debug line) must not
        be a collective. A freed unit's parameter says where its values are."""
        if _freed_unit(self) is None:
            _gather_for_use(self)  # plain again (its unit is whole, or gone)
            return nn.Parameter.__repr__(self)
        return (
            f"Parameter(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
            "values in ZeRO stage-3 shards: an op or .data on every rank gathers them)"
        )

    def __format__(self, format_spec: str) -> str:
        if _freed_unit(self) is None:
            return nn.Parameter.__format__(self, format_spec)
        return object.__format__(self, format_spec)  # the repr above

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        """A plain parameter holding the values (gathered), as DDP's deep copy holds."""
        if id(self) not in memo:
            values = self.data.clone(memory_format=torch.preserve_format)
            memo[id(self)] = nn.Parameter(values, self.requires_grad)
        return memo[id(self)]


@dataclass(frozen=True)
class _Mark:
    """A marked parameter's way back to its unit, held weakly: a dropped engine (and its
    process groups) must not be kept alive by the parameters of a model kept."""

    param: weakref.ref
    reads: weakref.ref
    unit: weakref.ref
    placeholder: int  # the address the freed parameter shows


_MARKED: dict[int, _Mark] = {}  # id(parameter) -> its mark, while marked


def _address(param: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return param.data_ptr()


def _own_mark(param: nn.Parameter) -> _Mark | None:
    """`param`'s mark (none for a copy made while marked, whose id may be another's)."""
    mark = _MARKED.get(id(param))
    return mark if mark is not None and mark.param() is param else None


def _freed_unit(param: nn.Parameter) -> FlatUnit | None:
    """The freed unit of a marked parameter, if it has one now."""
    mark = _own_mark(param)
    unit = mark.unit() if mark is not None else None
    return unit if unit is not None and not unit.gathered else None


def _gather_for_use(param: nn.Parameter) -> None:
    mark = _own_mark(param)
    reads, unit = (mark.reads(), mark.unit()) if mark is not None else (None, None)
    # Plain again, as it is: a copy made while marked, a parameter whose engine is gone,
    # one whose `.data` was replaced (it holds values of its own).
    if reads is None or unit is None or _address(param) != mark.placeholder:
        if mark is not None:
            del _MARKED[id(param)]
        param.__class__ = nn.Parameter
        return
    if not unit.gathered:
        if in_backward() or torch.compiler.is_compiling():
            return  # backward gathers what it needs itself; the placeholder reads NaN
        reads.gather_read(unit)
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
    """A handle whose removal stops the marking and turns the parameters still marked
    back into plain ones."""

    def __init__(self, reads: ParameterReads, units: list[FlatUnit]):
        self.reads, self.units = reads, units

    def remove(self) -> None:
        for unit in self.units:
            unit.on_freed = None
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
        self._marked: dict[int, list[nn.Parameter]] = {}  # unit index -> its marked params

    def install(
        self, model: nn.Module, units: list[FlatUnit], gather: Callable[[FlatUnit], None]
    ) -> list[_Reclassed | _Unmarking]:
        """Mark the parameters of each unit freed between uses whenever it is freed (now,
        if it is); re-class the modules owning parameters that cannot be marked. `gather
        (unit)` makes a unit whole. Returns the handles that undo it."""
        self._gather = gather
        owned: dict[str, dict[str, FlatUnit]] = {}
        for unit in units:
            if unit.persistent or not unit.layout.numel:
                continue
            unit.on_freed = self._mark
            if not unit.gathered:
                self._mark(unit)
            for slot, param in zip(unit.layout.slots, unit.params):
                if type(param) in (nn.Parameter, _ValuesOnUse):
                    continue
                for name in (slot.name, *slot.aliases):
                    path, _, attribute = name.rpartition(".")
                    if path:
                        owned.setdefault(path, {})[attribute] = unit
        handles: list[_Reclassed | _Unmarking] = []
        for path, names in owned.items():
            module = model.get_submodule(path)
            cls = type(module)
            if isinstance(module, torch.jit.ScriptModule) or _FACE in module.__dict__:
                continue
            module.__dict__[_FACE] = _Face(names, self._read)
            module.__class__ = _reading_class(cls)
            handles.append(_Reclassed(module, cls))
        return [*handles, _Unmarking(self, units)]

    def _read(self, unit: FlatUnit) -> None:
        """A module's attribute read found an unmarkable parameter of the freed `unit`:
        gather it now."""
        if not in_backward():
            self.gather_read(unit)

    def _mark(self, unit: FlatUnit) -> None:
        """`unit` is freed: its plain parameters are marked, to gather it at their first
        op that needs values."""
        marked = self._marked.setdefault(unit.layout.index, [])
        for param in unit.params:
            if type(param) is nn.Parameter:
                _MARKED[id(param)] = _Mark(
                    weakref.ref(param), weakref.ref(self), weakref.ref(unit), _address(param)
                )
                param.__class__ = _ValuesOnUse
                marked.append(param)

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
        """The marked parameters of `unit` (of every unit when None) are plain again: a
        gather pointed them at values, or the engine lets go of the model."""
        indices = list(self._marked) if unit is None else [unit.layout.index]
        for index in indices:
            for param in self._marked.pop(index, ()):
                _MARKED.pop(id(param), None)
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
        """Before a gather points the unit's parameters at values: they are plain again
        (an op in forward costs nothing extra)."""
        self.unmark(unit)
        return self._inner.taken(unit)

    def adopt_unit(self, unit: FlatUnit, written: dict[int, torch.Tensor] | None = None) -> None:
        """Before a free (`written` None): a unit a read gathered keeps what was written
        to it in place, then `inner` adopts replaced `.data`."""
        held = self.held.pop(unit.layout.index, None) if written is None else None
        if held is not None:
            self._write_back(unit, held[1])
        self._inner.adopt_unit(unit, written)
