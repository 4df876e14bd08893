"""`.grad` at stages 2-3: each parameter's gradient shown over this rank's shard of it.

After a synchronised backward, stages 2-3 hold only this rank's slice of each unit's
reduced gradient (the fp32 `grad_opt`). Code written against DDP reads `p.grad` anyway:
Lightning's `grad_norm`, `torch.nn.utils.clip_grad_norm_` written by hand, a dtype check,
a histogram. `ShardedGrad` is the face that code meets: a tensor with the parameter's
shape, dtype and device whose values are the shards, so that

- norms (`p.grad.norm()`, `torch.linalg.vector_norm`, `torch._foreach_norm`) are computed
  from each rank's part and one small all-reduce: nothing full-size is held;
- in-place pointwise changes (`mul_`, `clamp_`, `zero_`, `copy_` of a full tensor: what
  `clip_grad_norm_` and `clip_grad_value_` do) change this rank's part, which is the
  memory the optimizer steps: a clip by hand reaches the step;
- anything else (`p.grad.sum()`, `.cpu()`, `torch.allclose`, `p.grad[0] = 0`) gathers this
  one parameter's gradient (a collective over its unit's shard group), runs the op on it,
  and for a write takes this rank's part of the result back.

Every read that communicates is collective: every rank of the unit's shard group makes
it, in the same order (as with FSDP2's DTensor gradients). Values are unscaled (an fp16
loss scale still in the shards is divided out) and in the parameter's dtype, as DDP's
`.grad` is; they are computed from the fp32 reduced shards.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from ..layout.partition import ParamSlot
from ..tensor_parallel import local_tensor, set_local_grad
from ..units.flat_unit import FlatUnit
from ..units.no_gradient import given_anywhere
from . import grad_collectives

aten = torch.ops.aten

_DROPPED = (
    "This .grad belongs to a ZeroEngine that has been dropped, and its shards with it. "
    "Read gradients (or copy them: p.grad.clone() on every rank) while the engine lives, "
    "or set p.grad = None."
)

# In-place ops that act on each element alone besides those torch tags pointwise.
_ELEMENTWISE_IN_PLACE = {aten.copy_.default, aten.zero_.default, aten.fill_.Scalar}
# Those of them that commute with a loss scale still in the shards (x*s op y == (x op y)*s).
_SCALE_FREE = {
    aten.mul_.Tensor,
    aten.mul_.Scalar,
    aten.div_.Tensor,
    aten.div_.Scalar,
    aten.zero_.default,
    aten.neg_.default,
}
# torch._foreach_<op>_ (what clip_grad_norm_/clip_grad_value_ call with foreach=True) and
# the per-tensor method each element becomes.
_FOREACH_IN_PLACE = {
    "_foreach_mul_": "mul_",
    "_foreach_div_": "div_",
    "_foreach_add_": "add_",
    "_foreach_sub_": "sub_",
    "_foreach_clamp_min_": "clamp_min_",
    "_foreach_clamp_max_": "clamp_max_",
    "_foreach_zero_": "zero_",
    "_foreach_copy_": "copy_",
}


@dataclass
class GradReads:
    """What every face of one engine shares: how to wait for the reductions, the loss
    scale still in the shards, the gradients shown, the norms computed over them since
    they last changed, and the largest transient memory a read has taken."""

    wait: Callable[[], None]
    scale_left: Callable[[], float]
    largest_read_bytes: int = 0
    shown: list[GradSource] = field(default_factory=list)
    _totals: dict[float, dict[int, torch.Tensor]] = field(default_factory=dict)

    def note(self, nbytes: int) -> None:
        self.largest_read_bytes = max(self.largest_read_bytes, nbytes)

    def changed(self) -> None:
        """The shards changed (a write through a face, a clip or unscale by the engine,
        a new backward): norms are computed afresh."""
        self._totals.clear()

    def totals(self, ord: float) -> dict[int, torch.Tensor]:
        """Every shown gradient's norm of order `ord` before its root, by id(source).
        The first norm asked for after a change computes them all at once, with one
        all-reduce per shard group: a loop of `p.grad.norm()` (Lightning's `grad_norm`,
        `clip_grad_norm_` over tensors it cannot batch) then communicates once."""
        if ord not in self._totals:
            self.wait()
            values = _reduced_parts(self.shown, ord)
            self._totals[ord] = {id(s): v for s, v in zip(self.shown, values)}
        return self._totals[ord]


class GradSource:
    """One parameter's reduced gradient: its slot in `unit`, spread over the unit's shard
    group in rank order. The unit is held weakly: a `.grad` the model keeps must not keep
    a dropped engine's shards alive."""

    def __init__(self, unit: FlatUnit, slot: ParamSlot, reads: GradReads):
        self._unit = weakref.ref(unit)
        self.slot = slot
        self.reads = reads

    @property
    def unit(self) -> FlatUnit:
        unit = self._unit()
        if unit is None:
            raise RuntimeError(_DROPPED)
        return unit

    def part(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of the parameter's flat elements that `rank` of the group holds."""
        start, end = self.unit.layout.shard_range(rank)
        lo, hi = max(start, self.slot.offset), min(end, self.slot.end)
        return (lo - self.slot.offset, hi - self.slot.offset) if lo < hi else (0, 0)

    def local(self) -> torch.Tensor:
        """This rank's part: a view of the fp32 gradient shard (in memory: the caller is
        inside `unit.grads_resident()`)."""
        lo, hi = self.part(self.unit.group.rank)
        base = self.slot.offset - self.unit.opt_start
        return self.unit.grad_opt[base + lo : base + hi]

    def full(self) -> torch.Tensor:
        """The whole gradient, unscaled, in the master dtype: one all-gather of the ranks'
        parts (padded to the longest) over the unit's shard group."""
        self.reads.wait()
        comm = self.unit.group.comm
        parts = [self.part(r) for r in range(comm.size)]
        longest = max(hi - lo for lo, hi in parts)
        with self.unit.grads_resident():
            mine = self.local().to(self.unit.device)
            send = torch.zeros(longest, dtype=mine.dtype, device=mine.device)
            send[: mine.numel()].copy_(mine)
        gathered = torch.empty(comm.size * longest, dtype=send.dtype, device=send.device)
        comm.all_gather(gathered, send)
        whole = torch.empty(self.slot.numel, dtype=send.dtype, device=send.device)
        for r, (lo, hi) in enumerate(parts):
            whole[lo:hi] = gathered[r * longest : r * longest + hi - lo]
        self.reads.note((gathered.numel() + whole.numel() + send.numel()) * send.element_size())
        scale = self.reads.scale_left()
        if scale != 1.0:
            whole.div_(scale)
        return whole.view(self.slot.shape)

    def write_back(self, whole: torch.Tensor) -> None:
        """Take this rank's part of `whole` (unscaled values of the full gradient)."""
        lo, hi = self.part(self.unit.group.rank)
        values = whole.reshape(-1)[lo:hi]
        scale = self.reads.scale_left()
        with torch.no_grad(), self.unit.grads_resident(modified=True):
            local = self.local()
            local.copy_(values.to(local.device, local.dtype))
            if scale != 1.0:
                local.mul_(scale)


class ShardedGrad(torch.Tensor):
    """A parameter's `.grad` at stages 2-3 (see the module's docstring). `_views` are the
    view ops applied since `p.grad` (`p.grad[0]`, `.view(-1)`): reads and writes go
    through the whole gradient with them re-applied."""

    _source: GradSource
    _views: tuple

    @staticmethod
    def __new__(cls, source: GradSource, dtype: torch.dtype, device: torch.device, views=()):
        shape, stride = _shape_after(source.slot.shape, dtype, views)
        face = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=stride, dtype=dtype, device=device, requires_grad=False
        )
        face._source = source
        face._views = tuple(views)
        return face

    def __repr__(self, *, tensor_contents=None) -> str:  # no collective in a repr
        lo, hi = self._source.part(self._source.unit.group.rank)
        return (
            f"ShardedGrad(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"{hi - lo} of {self._source.slot.numel} elements on this rank; its values "
            "are read collectively, e.g. p.grad.clone() on every rank)"
        )

    def _with_views(self, views: tuple) -> ShardedGrad:
        return ShardedGrad(self._source, self.dtype, self.device, views)

    def _whole_master(self) -> torch.Tensor:
        """The whole gradient in the master dtype with this face's views applied."""
        return _apply_views(self._source.full(), self._views)

    def _value(self) -> torch.Tensor:
        """What DDP's `.grad` (or its view) would hold: the parameter's dtype and device."""
        return self._whole_master().to(self.device, self.dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Collectives by hand on the gradient (DDP code synchronising it itself).
        if func is dist.all_reduce:
            return grad_collectives.all_reduce(*args, **(kwargs or {}))
        if func is dist.broadcast:
            return grad_collectives.broadcast(*args, **(kwargs or {}))
        with torch._C.DisableTorchFunctionSubclass():  # the rest: __torch_dispatch__ below
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._with_views(args[0]._views)
        if func.is_view and isinstance(args[0], ShardedGrad):
            face = args[0]
            return face._with_views((*face._views, (func, args[1:], kwargs)))
        if func is aten.linalg_vector_norm.default and _whole(args[0]) and _no_dim(args, kwargs):
            return _norms([args[0]], _ord(args, kwargs), kwargs.get("dtype"))[0]
        if func is aten._foreach_norm.Scalar:
            return _foreach_norm(args[0], args[1] if len(args) > 1 else 2, kwargs.get("dtype"))
        name = func.overloadpacket.__name__
        if name in _FOREACH_IN_PLACE:
            _foreach_in_place(_FOREACH_IN_PLACE[name], args, kwargs)
            return None
        if func._schema.is_mutable and isinstance(args[0], ShardedGrad):
            _in_place(func, args[0], args[1:], kwargs)
            return args[0]
        if func._schema.is_mutable:
            raise RuntimeError(
                f"{func} would write into a tensor from a sharded gradient (p.grad at "
                "stages 2-3) held by another argument; write into p.grad itself, or into "
                "a copy (p.grad.clone())."
            )
        # A read: every face among the arguments becomes its whole value.
        return func(*tree_map(_valued, args), **tree_map(_valued, kwargs))


def _valued(x):
    return x._value() if isinstance(x, ShardedGrad) else x


def _whole(x) -> bool:
    return isinstance(x, ShardedGrad) and not x._views


def _no_dim(args, kwargs) -> bool:
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    return dim is None and not keepdim


def _ord(args, kwargs) -> float:
    return float(args[1] if len(args) > 1 else kwargs.get("ord", 2))


def _shape_after(shape: torch.Size, dtype: torch.dtype, views) -> tuple:
    """The shape and strides a chain of view ops gives (run on a meta tensor)."""
    meta = _apply_views(torch.empty(shape, dtype=dtype, device="meta"), views)
    return meta.shape, meta.stride()


def _apply_views(tensor: torch.Tensor, views) -> torch.Tensor:
    for func, rest, kwargs in views:
        tensor = func(tensor, *rest, **kwargs)
    return tensor


def _in_place(func, face: ShardedGrad, rest: tuple, kwargs: dict) -> None:
    """An in-place op on `face`: on this rank's part alone when it is elementwise over the
    whole gradient with no loss scale in the way, else on the gathered whole (collective)
    with this rank's part taken back."""
    source = face._source
    source.reads.wait()
    source.reads.changed()
    local_args = _local_arguments(face, rest) if _whole(face) else None
    elementwise = torch.Tag.pointwise in func.tags or func in _ELEMENTWISE_IN_PLACE
    unscaled = source.reads.scale_left() == 1.0 or func in _SCALE_FREE
    if local_args is not None and elementwise and unscaled:
        with torch.no_grad(), source.unit.grads_resident(modified=True):
            local = source.local()
            func(local, *tree_map(lambda a: _on(a, local), local_args), **kwargs)
        return
    whole = source.full()
    target = _apply_views(whole, face._views)
    func(target, *tree_map(_valued, rest), **tree_map(_valued, kwargs))
    source.write_back(whole)


def _on(arg, local: torch.Tensor):
    return arg.to(local.device) if isinstance(arg, torch.Tensor) else arg


def _local_arguments(face: ShardedGrad, rest: tuple) -> tuple | None:
    """`rest` with every full-shaped tensor cut to this rank's part; None when an argument
    is neither a number, a one-element tensor nor a tensor of the gradient's shape."""
    lo, hi = face._source.part(face._source.unit.group.rank)
    out = []
    for arg in rest:
        if isinstance(arg, ShardedGrad):
            return None
        if isinstance(arg, torch.Tensor) and arg.numel() != 1:
            if arg.shape != face.shape:
                return None
            arg = arg.reshape(-1)[lo:hi]
        out.append(arg)
    return tuple(out)


def _foreach_in_place(method: str, args: tuple, kwargs: dict) -> None:
    """A foreach in-place op, element by element (faces each on their own part)."""
    tensors, rest = args[0], args[1:]
    for i, tensor in enumerate(tensors):
        each = [r[i] if isinstance(r, (list, tuple)) else r for r in rest]
        getattr(tensor, method)(*each, **kwargs)


def _foreach_norm(tensors: Sequence[torch.Tensor], ord: float, dtype) -> list[torch.Tensor]:
    faces = [t for t in tensors if _whole(t)]
    normed = iter(_norms(faces, float(ord), dtype))
    return [
        next(normed) if _whole(t) else torch.linalg.vector_norm(_valued(t), ord, dtype=dtype)
        for t in tensors
    ]


def _norms(faces: Sequence[ShardedGrad], ord: float, dtype) -> list[torch.Tensor]:
    """Each face's norm of order `ord`, from the shown gradients' norms (`totals`), or
    for a face no longer shown, reduced for it alone."""
    if not faces:
        return []
    reads = faces[0]._source.reads
    table = reads.totals(ord)
    missing = [f._source for f in faces if id(f._source) not in table]
    if missing:
        table = {**table, **dict(zip(map(id, missing), _reduced_parts(missing, ord)))}
    scale = reads.scale_left()
    out = []
    for face in faces:
        total = table[id(face._source)]
        norm = total if ord in (0.0, math.inf, -math.inf) else total ** (1.0 / ord)
        if scale != 1.0 and ord != 0.0:
            norm = norm / scale
        out.append(norm.to(face.device, dtype or face.dtype))
    return out


def _reduced_parts(sources: Sequence[GradSource], ord: float) -> list[torch.Tensor]:
    """Each source's part of the norm of order `ord` (`_part_of_norm`), reduced over its
    shard group: one all-reduce per distinct group, in the order the groups first appear
    (the same on every rank of a group: the same parameters in the same order)."""
    by_comm: dict[int, list[int]] = {}
    partial = []
    for i, source in enumerate(sources):
        unit = source.unit
        with unit.grads_resident():
            partial.append(_part_of_norm(source.local(), ord).to(unit.device))
        by_comm.setdefault(id(unit.group.comm), []).append(i)
    totals: list[torch.Tensor] = [torch.empty(0)] * len(sources)
    op = {math.inf: dist.ReduceOp.MAX, -math.inf: dist.ReduceOp.MIN}.get(ord, dist.ReduceOp.SUM)
    for indices in by_comm.values():
        stacked = torch.stack([partial[i] for i in indices])
        sources[indices[0]].unit.group.comm.control_all_reduce(stacked, op)
        for k, i in enumerate(indices):
            totals[i] = stacked[k]
    return totals


def _part_of_norm(local: torch.Tensor, ord: float) -> torch.Tensor:
    """This rank's contribution to a norm, in fp64: the sum of |x|^ord (the count of
    nonzeros for 0), or the max/min of |x| for +-inf (the reduction's identity when the
    rank holds no element)."""
    if ord == math.inf:
        return local.abs().max().double() if local.numel() else torch.zeros((), dtype=torch.float64)
    if ord == -math.inf:
        return (
            local.abs().min().double()
            if local.numel()
            else torch.full((), math.inf, dtype=torch.float64)
        )
    if ord == 0.0:
        return (local != 0).sum().double()
    # accumulated in the shard's dtype (torch's cascaded sums), the power taken in fp64
    return torch.linalg.vector_norm(local, ord).double() ** ord


class GradFaces:
    """Puts a `ShardedGrad` on the `.grad` of every trainable parameter some rank gave a
    gradient, after a synchronised backward (stages 2-3), and takes them off before the
    next backward or at zero_grad."""

    def __init__(self, units: Sequence[FlatUnit], reads: GradReads):
        self.units = units
        self.reads = reads
        self._params: list[torch.Tensor] = []  # aligned with reads.shown

    def show(self) -> None:
        """A face on each trainable parameter some rank gave a gradient to; one that no
        rank did reads None, as DDP leaves a globally unused parameter's `.grad`
        (`_given`)."""
        self.reads.changed()
        sources = [
            (GradSource(unit, slot, self.reads), p)
            for unit in self.units
            if unit.stage >= 2 and unit.grad_opt is not None and unit.layout.numel
            for slot, p in zip(unit.layout.slots, unit.params)
            if slot.trainable
        ]
        for (source, p), given in zip(sources, _given([s for s, _ in sources])):
            if given:
                local = local_tensor(p)
                set_local_grad(p, ShardedGrad(source, local.dtype, local.device))
                self.reads.shown.append(source)
                self._params.append(p)

    def cleared(self) -> set[int]:
        """The param groups of shown gradients that user code set to None since."""
        return {
            gi
            for p, source in zip(self._params, self.reads.shown)
            if p.grad is None
            for gi in source.slot.groups
        }

    def hide(self, groups: set[int] | None = None) -> None:
        """The faces go: all, or those of the parameters in any of `groups` (one
        optimizer's `zero_grad()` of several leaves the others' shown, as torch does)."""
        kept = []
        for p, source in zip(self._params, self.reads.shown):
            if groups is None or not groups.isdisjoint(source.slot.groups):
                p.grad = None
            else:
                kept.append((p, source))
        self._params[:] = [p for p, _ in kept]
        self.reads.shown[:] = [source for _, source in kept]
        self.reads.changed()


def _given(sources: Sequence[GradSource]) -> list[bool]:
    """Whether any rank gave each parameter a gradient since its last zeroing (its
    reduced shards hold more than "no gradient" marks, `units/no_gradient`). Offloaded
    gradient shards (read back only for a step) and tensor-parallel blocks (whose
    emptiness a position alone cannot tell) count as given, as every rank alike decides."""
    decided = [
        i for i, s in enumerate(sources) if s.unit.grad_home is None and not s.slot.tensor_sharded
    ]
    parts = [
        (sources[i].unit.group.comm, sources[i].unit.device, sources[i].local()) for i in decided
    ]
    given = [True] * len(sources)
    for i, answer in zip(decided, given_anywhere(parts)):
        given[i] = answer
    return given
