"""The layout: which parameter lives where in which flat buffer, and who owns which slice.

A unit (stage 3: a wrapped submodule; stages 0-2: a bucket of parameters) flattens its
parameters into one buffer padded to a multiple of its shard group's size; the group's
r-th rank owns the r-th contiguous slice. Each unit has one `ShardSpec` (the data-parallel
world unless a placement function chose another): a unit never mixes groups. Parameters are ordered by optimizer param group inside a unit, so each
rank's slice meets each group in one contiguous segment: the optimizer then steps a few
long 1-D views instead of many small ones, and per-group hyperparameters stay exact.

This map is the single source of truth for gathering, reducing, optimizer state and
checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..tensor_parallel import TensorPlacement, local_tensor, placement_of
from .shard_spec import ShardSpec, owner_of, within

FROZEN_GROUP = -1  # parameters that the optimizer does not update
# Each parameter starts at a multiple of this many elements of its unit's buffer: 64 bytes
# at 2-byte compute dtypes, where a fresh allocation would start. Kernels pick their
# vectorised paths by the address (oneDNN's convolutions round differently at another
# alignment; CUDA's vector loads need 16 bytes), so a parameter in a flat buffer computes
# as the same parameter allocated on its own: as under DDP, to the bit.
SLOT_ALIGNMENT = 32
FROZEN_PART = " (frozen)"  # the name of a module's unit of its frozen parameters
FP32_PART = " (fp32)"  # ... of its parameters that compute in fp32 (`fp32_params.py`)


@dataclass(frozen=True)
class ParamSlot:
    """One parameter inside a unit's flat buffer."""

    name: str  # first fully-qualified name; tied aliases are in `aliases`
    aliases: tuple[str, ...]
    shape: torch.Size
    dtype: torch.dtype
    offset: int
    group_index: int  # index into the optimizer's param groups, or FROZEN_GROUP
    # Tensor parallelism: where this rank's values sit in the full parameter (None: the
    # parameter is whole on every tensor-parallel rank, or there is no tensor parallelism).
    tensor: TensorPlacement | None = None
    # Groups of later optimizers that hold the parameter too (one parameter stepped by two
    # optimizers, as alternating SGD and Adam): each steps the same elements with a
    # state of its own.
    later_groups: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def tensor_sharded(self) -> bool:
        """Each tensor-parallel rank holds different values (a shard) of this parameter."""
        return self.tensor is not None and self.tensor.sharded

    @property
    def end(self) -> int:
        return self.offset + self.numel

    @property
    def trainable(self) -> bool:
        return self.group_index != FROZEN_GROUP

    @property
    def groups(self) -> tuple[int, ...]:
        """Every param group holding the parameter, its layout's group first."""
        return (self.group_index, *self.later_groups) if self.trainable else ()


@dataclass(frozen=True)
class Stored:
    """Where a parameter lives in a checkpoint: a tensor's name, its full shape, and the
    element offset of this parameter's values in that tensor's flattening."""

    name: str
    shape: tuple[int, ...]
    offset: int = 0


@dataclass(frozen=True)
class Segment:
    """The intersection of one rank's slice with one param group's region of a unit."""

    group_index: int
    start: int  # offset in the unit's flat (unsharded) buffer
    end: int
    later_groups: tuple[int, ...] = ()  # later optimizers' groups over the same elements

    @property
    def numel(self) -> int:
        return self.end - self.start

    def in_groups(self, groups: set[int] | None) -> bool:
        """Whether any of `groups` (every group when None) holds these elements."""
        return (
            groups is None or self.group_index in groups or not groups.isdisjoint(self.later_groups)
        )


@dataclass
class UnitLayout:
    index: int
    name: str  # module path ("" = root) for stage 3, "bucket<i>" otherwise
    slots: list[ParamSlot]
    world_size: int  # ranks the unit is sharded over (its group's size; 1 at stage 0)
    spec: ShardSpec  # the groups that shard (or, at stage 0, replicate) this unit
    module_path: str | None = None  # stage 3 only
    # fp32 for parameters kept in fp32 under bf16/fp16 compute; None: the engine's dtype.
    compute_dtype: torch.dtype | None = None
    _segments: dict[int, list[Segment]] = field(default_factory=dict, repr=False)

    @property
    def numel(self) -> int:
        return self.slots[-1].end if self.slots else 0

    @property
    def padded_numel(self) -> int:
        return math.ceil(self.numel / self.world_size) * self.world_size if self.numel else 0

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def trainable(self) -> bool:
        return any(s.trainable for s in self.slots)

    @property
    def all_trainable(self) -> bool:
        return all(s.trainable for s in self.slots)

    def padding(self) -> list[tuple[int, int]]:
        """The [start, end) runs of the flat buffer that no parameter holds: between slots
        (`SLOT_ALIGNMENT`) and after the last, to `padded_numel`."""
        runs, at = [], 0
        for slot in self.slots:
            if at < slot.offset:
                runs.append((at, slot.offset))
            at = slot.end
        if at < self.padded_numel:
            runs.append((at, self.padded_numel))
        return runs

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def name_later_groups(self, later: dict[str, tuple[int, ...]]) -> None:
        """Record on each slot the later optimizers' groups that hold its parameter too
        (`later`: by the parameter's first name)."""
        self.slots = [
            replace(slot, later_groups=later[slot.name]) if slot.name in later else slot
            for slot in self.slots
        ]
        self._segments.clear()

    def segments(self, start: int, end: int, groups: set[int] | None = None) -> list[Segment]:
        """Contiguous pieces of [start, end) held by one set of param groups, trainable
        groups only; with `groups`, those held by any of them. Each element is in one
        piece."""
        key = start * 1_000_003 + end
        if key not in self._segments:
            pieces: list[Segment] = []
            for slot in self.slots:
                lo, hi = max(start, slot.offset), min(end, slot.end)
                if lo >= hi or not slot.trainable:
                    continue
                last = pieces[-1] if pieces else None
                if (  # the padding between two slots of one group steps with them
                    last is not None
                    and _aligned(last.end) >= lo
                    and (last.group_index, last.later_groups)
                    == (slot.group_index, slot.later_groups)
                ):
                    pieces[-1] = Segment(slot.group_index, last.start, hi, slot.later_groups)
                else:
                    pieces.append(Segment(slot.group_index, lo, hi, slot.later_groups))
            self._segments[key] = pieces
        found = self._segments[key]
        return found if groups is None else [seg for seg in found if seg.in_groups(groups)]


# ---------------------------------------------------------------------------- building
@dataclass
class _Param:
    param: nn.Parameter
    names: list[str]
    local: torch.Tensor  # its values on this rank (a DTensor's local shard)
    tensor: TensorPlacement | None  # a DTensor's placement


def unique_parameters(model: nn.Module) -> list[_Param]:
    """Parameters in registration order, each once, with every name it is reachable by."""
    seen: dict[int, _Param] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        entry = seen.get(id(param))
        if entry is None:
            seen[id(param)] = _Param(param, [name], local_tensor(param), placement_of(param))
        else:
            entry.names.append(name)
    return list(seen.values())


def _make_slots(params: Sequence[_Param], group_of: dict[int, int]) -> list[ParamSlot]:
    # Stable sort by group: trainable groups in order, frozen last.
    def key(p: _Param) -> int:
        g = group_of.get(id(p.param), FROZEN_GROUP)
        return g if g != FROZEN_GROUP else 1 << 30

    slots, offset = [], 0
    for p in sorted(params, key=key):
        slots.append(
            ParamSlot(
                name=p.names[0],
                aliases=tuple(p.names[1:]),
                shape=p.local.shape,
                dtype=p.local.dtype,
                offset=offset,
                group_index=group_of.get(id(p.param), FROZEN_GROUP),
                tensor=p.tensor,
            )
        )
        offset = _aligned(offset + p.local.numel())
    return slots


def _aligned(offset: int) -> int:
    return -(-offset // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


def _is_trainable(p: _Param, group_of: dict[int, int]) -> bool:
    return group_of.get(id(p.param), FROZEN_GROUP) != FROZEN_GROUP


def split_by_trainability(
    members: Sequence[_Param], group_of: dict[int, int]
) -> list[list[_Param]]:
    """A unit's parameters as the units they make: one list, or, where trainable and
    frozen parameters mix (LoRA on a frozen block), the trainable ones and the frozen
    ones apart. Each is sharded evenly on its own, so each rank holds 1/N of the
    trainable elements, their gradients and optimizer state; in one flat buffer, sorted
    trainable first, they would all sit in the first rank's slice."""
    trainable = [p for p in members if _is_trainable(p, group_of)]
    frozen = [p for p in members if not _is_trainable(p, group_of)]
    return [trainable, frozen] if trainable and frozen else [list(members)]


def split_unit(
    members: Sequence[_Param],
    group_of: dict[int, int],
    kept_fp32: Callable[[Iterable[str]], bool],
) -> list[tuple[list[_Param], str, torch.dtype | None]]:
    """Stage 3: a module's parameters as the units they make, each with the suffix of
    its name and its compute dtype (None: the engine's): apart by trainability
    (`split_by_trainability`), and within each, the parameters kept in fp32 apart (one
    flat buffer holds one dtype)."""
    parts = []
    by_trainability = split_by_trainability(members, group_of)
    for i, part in enumerate(by_trainability):
        frozen = FROZEN_PART if i else ""
        rest = [p for p in part if not kept_fp32(p.names)]
        fp32 = [p for p in part if kept_fp32(p.names)]
        if rest:
            parts.append((rest, frozen, None))
        if fp32:
            parts.append((fp32, frozen + FP32_PART, torch.float32))
    return parts


def fp32_owner_modules(
    model: nn.Module, params: Sequence[_Param], unit_paths: Iterable[str], kept_fp32
) -> list[str]:
    """Stage 3: the modules outside every unit that hold parameters kept in fp32 (a
    final norm, an lm_head): units of their own, so that those parameters can have an
    fp32 unit (the root unit holds one dtype). A parameter of the root module itself,
    or of a container never called, has no such module and stays in the root."""
    units = [u for u in unit_paths if u]
    found: list[str] = []
    for p in params:
        if not kept_fp32(p.names):
            continue
        for name in p.names:
            owner = owner_of(name)
            if (
                owner
                and owner not in found
                and not any(within(owner, u) for u in units)
                and not _never_called(model.get_submodule(owner))
            ):
                found.append(owner)
    return found


def _bucket_numel(p: _Param) -> int:
    """What a parameter counts against a bucket: its local size, or with tensor
    parallelism its largest block's (position 0's), so that every position cuts its
    buckets alike (an uneven split would otherwise give positions different units)."""
    if p.tensor is not None and p.tensor.sharded:
        return math.prod(p.tensor.block(0)[1])
    return p.local.numel()


def bucket_layouts(
    params: Sequence[_Param],
    group_of: dict[int, int],
    bucket_size: int,
    spec_of: Callable[[_Param], ShardSpec],
    sharded: bool = True,
    kept_fp32: Callable[[Iterable[str]], bool] = lambda names: False,
) -> list[UnitLayout]:
    """Stages 0-2: buckets in reverse registration order, roughly the order of backward;
    a bucket holds parameters of one spec. Unsharded (stage 0) buckets have one "shard".

    Trainable parameters fill their buckets first and frozen ones theirs after, never
    mixed: each rank's slice of a trainable bucket is then 1/N of its trainable elements
    (a LoRA adapter's few elements would otherwise all fall in the first rank's slice of
    a bucket led by them), and frozen buckets hold no gradient buffer. Parameters kept
    in fp32 (`kept_fp32`, by their names) fill fp32 buckets of their own likewise."""
    buckets: list[tuple[ShardSpec, bool, list[_Param]]] = []
    filled = 0
    for trainable in (True, False):
        for fp32 in (False, True):
            starting = True
            for p in reversed(params):
                if _is_trainable(p, group_of) != trainable or kept_fp32(p.names) != fp32:
                    continue
                spec = spec_of(p)
                numel = _bucket_numel(p)
                if starting or buckets[-1][0] != spec or filled + numel > bucket_size:
                    buckets.append((spec, fp32, []))
                    filled = 0
                    starting = False
                buckets[-1][2].append(p)
                filled += numel
    return [
        UnitLayout(
            index=i,
            name=f"bucket{i}",
            slots=_make_slots(members, group_of),
            world_size=spec.size if sharded else 1,
            spec=spec,
            compute_dtype=torch.float32 if fp32 else None,
        )
        for i, (spec, fp32, members) in enumerate(buckets)
    ]


def select_unit_modules(model: nn.Module, class_names: Iterable[str]) -> list[str]:
    """Stage 3: paths of the modules that become units (outermost only, never nested).

    With no class names given, every child of every nn.ModuleList is a unit (the blocks of
    almost every transformer); a model with no ModuleList gets one unit per direct child.
    A child that is a container with no forward of its own (an nn.ModuleDict of a block's
    layers) is never called, so its hooks would never run: its children stand in its
    place.
    """
    wanted = set(class_names)
    chosen: list[str] = []
    dissolved: set[str] = set()  # containers whose children stand in their place

    def covered(path: str) -> bool:
        return any(within(path, c) for c in chosen)

    for path, module in model.named_modules():
        if path == "" or covered(path):
            continue
        if wanted:
            if type(module).__name__ in wanted:
                chosen.append(path)
        else:
            parent_path = path.rsplit(".", 1)[0] if "." in path else ""
            parent = model.get_submodule(parent_path)
            in_a_list = isinstance(parent, nn.ModuleList) or parent_path in dissolved
            if in_a_list and any(True for _ in module.parameters()):
                if _never_called(module):
                    dissolved.add(path)
                else:
                    chosen.append(path)
    if wanted:
        found = {type(m).__name__ for _, m in model.named_modules()}
        missing = sorted(wanted - found)
        if missing:
            raise ValueError(
                f"ZeroConfig.unit_module_classes names {missing}, which the model does not "
                f"contain; its module classes are {sorted(found)}."
            )
    if not chosen and not wanted:
        chosen = [n for n, m in model.named_children() if any(True for _ in m.parameters())]
    return chosen


def _never_called(module: nn.Module) -> bool:
    """A container with no forward of its own (nn.ModuleDict, nn.ModuleList)."""
    return type(module).forward is nn.Module.forward


def frozen_leftover_modules(model: nn.Module, unit_paths: Iterable[str]) -> list[str]:
    """Stage 3: the outermost modules outside every unit whose parameters are all frozen,
    when the root unit (the parameters of no unit) would otherwise mix them with trainable
    ones: a distillation teacher's embeddings beside the student's, frozen embeddings under
    LoRA. As units of their own they stay out of the root's gradient buffer, reduction and
    optimizer shard boundaries."""
    units = [u for u in unit_paths if u]  # the root is never a unit of its own here

    def in_unit(path: str) -> bool:
        return any(within(path, u) for u in units)

    leftovers = [
        (path, p)
        for path, module in model.named_modules()
        if not in_unit(path)
        for p in module.parameters(recurse=False)
    ]
    if not any(p.requires_grad for _, p in leftovers) or all(p.requires_grad for _, p in leftovers):
        return []
    found: list[str] = []
    for path, module in model.named_modules():
        if not path or in_unit(path) or any(within(path, f) for f in found):
            continue
        if any(p.requires_grad for p in module.parameters()):
            continue
        if any(within(owner, path) for owner, _ in leftovers):
            found.append(path)
    return found


def module_layouts(
    model: nn.Module,
    params: Sequence[_Param],
    group_of: dict[int, int],
    unit_paths: Sequence[str],
    spec_of_unit: Callable[[str], ShardSpec],
    kept_fp32: Callable[[Iterable[str]], bool] = lambda names: False,
) -> list[UnitLayout]:
    """Stage 3: one unit per chosen module (units may nest: a module holds the parameters
    of no unit inside it), plus the root unit (index 0) for the rest. A module whose
    parameters are partly frozen makes two units, trainable then frozen, gathered
    together by its hooks (`split_by_trainability`); its parameters kept in fp32 make
    units of their own likewise (`split_unit`).

    A parameter reachable under several names (tied weights) belongs to the deepest unit
    that contains all of its owners, so that it is gathered wherever it is used.
    """

    def unit_of(module_path: str) -> str:
        best = ""
        for path in unit_paths:
            if within(module_path, path) and len(path) > len(best):
                best = path
        return best

    def common_unit(homes: set[str]) -> str:
        candidates = [""] + [  # the root holds every module
            p for p in unit_paths if all(within(h, p) for h in homes)
        ]
        return max(candidates, key=lambda p: len(p) if p else -1)

    members: dict[str, list[_Param]] = {"": [], **{p: [] for p in unit_paths}}
    for p in params:
        homes = {unit_of(owner_of(n)) for n in p.names}
        members[homes.pop() if len(homes) == 1 else common_unit(homes)].append(p)
    layouts = []
    for path in ["", *unit_paths]:
        if not members[path] and path:
            continue
        spec = spec_of_unit(path)
        # The root (index 0, gathered from the first use to the end of backward) stays
        # whole; its frozen modules are units of their own (frozen_leftover_modules).
        parts = (
            split_unit(members[path], group_of, kept_fp32) if path else [(members[path], "", None)]
        )
        for part, suffix, dtype in parts:
            layouts.append(
                UnitLayout(
                    index=len(layouts),
                    name=(path or "<root>") + suffix,
                    slots=_make_slots(part, group_of),
                    world_size=spec.size,
                    spec=spec,
                    module_path=path,
                    compute_dtype=dtype,
                )
            )
    return layouts
