"""Tensor parallelism beside ZeRO: a 2-D (data x tensor) mesh of ranks.

Tensor parallelism itself is torch's (`torch.distributed.tensor.parallel`): the user's
plan turns some parameters into DTensors, each rank holding its shard along the mesh's
tensor dimension. The engine then runs ZeRO over the data dimension alone, on each
parameter's *local* tensor: the ranks at one tensor-parallel position form a
data-parallel world of their own and shard, reduce and gather exactly as without tensor
parallelism. Only what spans positions crosses the tensor dimension: the gradient norm
(tensor-sharded parameters counted at every position, replicated ones once), agreement on
a skipped step, and checkpoints.

This module holds what the engine needs to know about that: the mesh's ranks
(`MeshLayout`), each parameter's local tensor and placement (`TensorPlacement`), and the
gradient of a DTensor parameter as a plain local tensor.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch without distributed
    DTensor = Replicate = Shard = None  # type: ignore[assignment,misc]


TENSOR_NAMES = ("tensor", "tp", "tensor_parallel")


@dataclass(frozen=True)
class MeshLayout:
    """The world's ranks as a (data, tensor) grid: `grid[d][t]` is the global rank at
    data-parallel index d and tensor-parallel position t."""

    grid: tuple[tuple[int, ...], ...]
    global_rank: int

    @classmethod
    def data_only(cls, world_size: int, rank: int) -> MeshLayout:
        return cls(tuple((r,) for r in range(world_size)), rank)

    @classmethod
    def contiguous(cls, world_size: int, tensor_size: int, rank: int) -> MeshLayout:
        """Tensor-parallel groups of consecutive ranks (the usual layout: a node's GPUs)."""
        if tensor_size <= 0 or world_size % tensor_size:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(
                f"tensor_parallel_size={tensor_size} does not divide the world size "
                f"{world_size}; use one of {divisors}."
            )
        return cls(
            tuple(tuple(range(d, d + tensor_size)) for d in range(0, world_size, tensor_size)),
            rank,
        )

    @classmethod
    def from_device_mesh(cls, mesh, rank: int) -> MeshLayout:
        """A 2-D DeviceMesh: its first dimension is data parallel, its last tensor parallel
        (as Lightning's ModelParallelStrategy and torchtitan name them)."""
        if mesh.ndim != 2:
            raise ValueError(
                f"device_mesh has {mesh.ndim} dimension(s) {mesh.mesh_dim_names}; pass a 2-D "
                "mesh (data, tensor), e.g. init_device_mesh('cpu', (dp, tp), "
                "mesh_dim_names=('data', 'tensor'))."
            )
        names = tuple(mesh.mesh_dim_names or ())
        if names and any(n in TENSOR_NAMES for n in names[:1]):
            raise ValueError(
                f"device_mesh has dimensions {names}: the tensor dimension comes last, "
                "(data, tensor), as init_device_mesh('cpu', (dp, tp), mesh_dim_names="
                "('data', 'tensor')) builds it."
            )
        grid = tuple(tuple(int(r) for r in row) for row in mesh.mesh.tolist())
        lines = [*grid, *zip(*grid)]  # each tensor group, each data-parallel group
        if any(list(line) != sorted(line) for line in lines):
            raise ValueError(
                f"device_mesh {mesh.mesh.tolist()}: the ranks along each of its dimensions "
                "must rise (torch numbers a group's ranks in rising order); build it with "
                "init_device_mesh."
            )
        return cls(grid, rank)

    @property
    def data_size(self) -> int:
        return len(self.grid)

    @property
    def tensor_size(self) -> int:
        return len(self.grid[0])

    @property
    def world_size(self) -> int:
        return self.data_size * self.tensor_size

    @property
    def data_index(self) -> int:
        return next(d for d, row in enumerate(self.grid) if self.global_rank in row)

    @property
    def tensor_index(self) -> int:
        return self.grid[self.data_index].index(self.global_rank)

    @property
    def tensor_group(self) -> tuple[int, ...]:
        """The global ranks of this rank's tensor-parallel group."""
        return self.grid[self.data_index]

    def position_of(self, rank: int) -> int:
        """The tensor-parallel position of a global rank."""
        return self._locate(rank)[1]

    def peer_at_my_position(self, rank: int) -> int:
        """The global rank at this rank's tensor-parallel position with `rank`'s
        data-parallel index."""
        return self.grid[self._locate(rank)[0]][self.tensor_index]

    def _locate(self, rank: int) -> tuple[int, int]:
        for d, row in enumerate(self.grid):
            if rank in row:
                return d, row.index(rank)
        raise ValueError(
            f"rank {rank} is not in the mesh {[list(r) for r in self.grid]}; give a global "
            f"rank between 0 and {self.world_size - 1}."
        )

    def expand(self, partition: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """A split of data-parallel indices, as global ranks at every tensor position: each
        position's data-parallel world is split alike (group creation is collective over
        the whole world, so every rank creates every position's groups)."""
        return tuple(
            tuple(self.grid[d][t] for d in group)
            for t in range(self.tensor_size)
            for group in partition
        )

    def tensor_partition(self) -> tuple[tuple[int, ...], ...]:
        return self.grid

    def everyone(self) -> tuple[tuple[int, ...], ...]:
        return (tuple(sorted(r for row in self.grid for r in row)),)


# ---------------------------------------------------------------------------- parameters
def is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The plain tensor a parameter's values live in on this rank: a DTensor's local
    shard (the same object for the DTensor's lifetime: the engine re-points its `.data`),
    the parameter itself otherwise."""
    return p._local_tensor if is_dtensor(p) else p


Block = tuple[tuple[int, ...], tuple[int, ...]]  # (starts, shape) in the full tensor


@dataclass(frozen=True)
class TensorPlacement:
    """A DTensor parameter on a 1-D tensor-parallel mesh: each of the `size` positions
    holds the block of the full (logical) tensor that its placements give it, and this
    rank holds `position`'s. Shards follow torch.chunk, as DTensor's do: the first
    positions take the larger pieces, the last may be empty.

    Checkpoints store a sharded parameter's blocks one after another (position order),
    each flattened on its own: a rank's block is then one contiguous range at `offset`,
    written and (at the same tensor-parallel size) read like any parameter's range."""

    full_shape: tuple[int, ...]
    placements: tuple[str, ...]  # "Shard(d)" or "Replicate()", one per mesh dimension
    position: int
    size: int

    @property
    def sharded(self) -> bool:
        return any(s.startswith("Shard") for s in self.placements)

    def block(self, position: int) -> Block:
        starts, shape = [0] * len(self.full_shape), list(self.full_shape)
        for placement in self.placements:
            if placement.startswith("Shard"):
                dim = int(placement[len("Shard(") : -1])
                chunk = -(-self.full_shape[dim] // self.size)
                starts[dim] = min(position * chunk, self.full_shape[dim])
                shape[dim] = max(0, min(chunk, self.full_shape[dim] - starts[dim]))
        return tuple(starts), tuple(shape)

    def blocks(self) -> list[Block]:
        return [self.block(p) for p in range(self.size)]

    @property
    def offset(self) -> int:
        """Where this rank's block starts in the stored (block after block) flattening."""
        return sum(math.prod(shape) for _, shape in self.blocks()[: self.position])


def placement_of(p: torch.Tensor) -> TensorPlacement | None:
    """A DTensor parameter's placement on its (1-D) tensor-parallel mesh; None for a plain
    one."""
    if not is_dtensor(p):
        return None
    names = tuple(
        f"Shard({x.dim % p.dim()})" if isinstance(x, Shard) else "Replicate()" for x in p.placements
    )
    mesh = p.device_mesh
    placed = TensorPlacement(tuple(p.shape), names, mesh.get_local_rank(), mesh.size())
    if placed.block(placed.position)[1] != tuple(p._local_tensor.shape):
        raise ValueError(
            f"A DTensor parameter of shape {tuple(p.shape)} with placements {p.placements} "
            f"holds a local shard of shape {tuple(p._local_tensor.shape)}, not torch.chunk's "
            "split; shard parameters with distribute_tensor / parallelize_module."
        )
    return placed


def read_block(
    target: Block,
    sources: list[Block],
    read_source: Callable[[int], torch.Tensor],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The `target` block of a full tensor whose stored form is `sources` (blocks, one
    after another): each overlapping source block is read whole (`read_source(k)`, its
    flat values) and its overlap copied in. A tensor-parallel size change reads this way."""
    t_starts, t_shape = target
    out = torch.empty(t_shape, dtype=dtype)
    for k, (s_starts, s_shape) in enumerate(sources):
        lows = [max(a, b) for a, b in zip(t_starts, s_starts)]
        highs = [min(a + n, b + m) for a, n, b, m in zip(t_starts, t_shape, s_starts, s_shape)]
        if any(lo >= hi for lo, hi in zip(lows, highs)):
            continue
        values = read_source(k).view(s_shape)
        src = tuple(slice(lo - s, hi - s) for lo, hi, s in zip(lows, highs, s_starts))
        dst = tuple(slice(lo - t, hi - t) for lo, hi, t in zip(lows, highs, t_starts))
        out[dst] = values[src]
    return out


def check_parameters(named: Sequence[tuple[str, torch.Tensor]], layout: MeshLayout) -> None:
    """DTensor parameters must be tensor-parallel over this rank's tensor group of the
    engine's mesh, and a model with any needs a mesh: refuse anything else, naming it."""
    dtensors = [(n, p) for n, p in named if is_dtensor(p)]
    if not dtensors:
        return
    name, p = dtensors[0]
    if layout.tensor_size == 1:
        ranks = p.device_mesh.mesh.flatten().tolist()
        raise ValueError(
            f"Parameter {name!r} is a DTensor (tensor parallel over ranks {ranks}), but the "
            "engine was given no tensor-parallel mesh. Pass device_mesh=<the 2-D (data, "
            "tensor) mesh the plan was applied on>, or tensor_parallel_size="
            f"{len(ranks)}."
        )
    for name, p in dtensors:
        mesh = p.device_mesh
        ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        if mesh.ndim != 1 or ranks != layout.tensor_group:
            raise ValueError(
                f"Parameter {name!r} is a DTensor on a mesh of ranks "
                f"{mesh.mesh.tolist()}, but this rank's tensor-parallel group is "
                f"{list(layout.tensor_group)}. Apply the tensor-parallel plan on the mesh's "
                "'tensor' dimension (device_mesh['tensor']); a model already sharded by "
                "fully_shard cannot be sharded again."
            )
        if any(not isinstance(x, (Shard, Replicate)) for x in p.placements):
            raise ValueError(
                f"Parameter {name!r} has placements {p.placements}; a parameter is either "
                "sharded (Shard) or replicated (Replicate) over the tensor dimension."
            )


def real_dtensor_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A DTensor of `p`'s mesh, placements and shape over `local` (a meta parameter's
    real replacement; its local shard is resized when the engine points it at memory)."""
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


@contextlib.contextmanager
def whole_for_init(
    model: nn.Module, targets: Sequence[tuple[Sequence[str], TensorPlacement, torch.Tensor]]
) -> Iterator[None]:
    """Inside, each tensor-sharded parameter (by every name of it) is a plain tensor of
    its full shape, for the model's own initialisation of a meta-built model; on leaving,
    this rank's block of it goes to its target (the flat slice) and the DTensor is back.
    Every position then draws the same full tensor and keeps its block: the weights the
    model would have without tensor parallelism (DTensor's own random ops on shards give
    every position the same shard where it tracks no RNG offsets, on CPU)."""
    swapped = []
    for names, placement, target in targets:
        original = model.get_parameter(names[0])
        whole = nn.Parameter(
            torch.empty(placement.full_shape, dtype=target.dtype, device=target.device),
            requires_grad=original.requires_grad,
        )
        for name in names:
            _set_parameter(model, name, whole)
        swapped.append((names, original, whole, placement, target))
    finished = False
    try:
        yield
        finished = True
    finally:
        for names, original, whole, placement, target in swapped:
            if finished:
                starts, shape = placement.block(placement.position)
                block = whole.detach()[tuple(slice(a, a + n) for a, n in zip(starts, shape))]
                target.copy_(block.reshape(-1))
            for name in names:
                _set_parameter(model, name, original)


def _set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner), attr, value)


def match_local_dtype(p: torch.Tensor) -> None:
    """A DTensor's dtype is fixed when it is made, but the engine gives its local shard
    the compute dtype (bf16 views of its buffers), or back the masters' (release): wrap
    the local shard again, in place, so that the parameter, its gradients and its
    state_dict() carry the dtype it computes in."""
    if is_dtensor(p) and p.dtype != p._local_tensor.dtype:
        again = nn.Parameter(real_dtensor_like(p, p._local_tensor), requires_grad=p.requires_grad)
        torch.utils.swap_tensors(p, again)


HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")


def check_head_counts(named: Sequence[tuple[str, torch.Tensor]], config, tensor_size: int) -> None:
    """A plan that shards attention splits its heads: each rank must get whole ones. The
    model's (Hugging Face style) config says how many there are."""
    attention_sharded = any(
        ("attn" in name or "attention" in name)
        and is_dtensor(p)
        and any(isinstance(x, Shard) for x in p.placements)
        for name, p in named
    )
    if not attention_sharded or config is None:
        return
    for attr in HEAD_COUNTS:
        count = getattr(config, attr, None)
        if isinstance(count, int) and not isinstance(count, bool) and count % tensor_size:
            divisors = [d for d in range(1, count + 1) if count % d == 0]
            raise ValueError(
                f"The model's config.{attr}={count} is not divisible by "
                f"tensor_parallel_size={tensor_size}: the plan would split a head across "
                f"ranks. Use a tensor_parallel_size that divides {count} (one of "
                f"{divisors}), or keep attention out of the plan."
            )


# ---------------------------------------------------------------------------- gradients
def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """A parameter's gradient as a plain tensor of its local shape. A DTensor gradient
    with another placement than its parameter (a replicated weight used on sequence
    shards has a Partial one) is first brought to the parameter's (a collective over the
    tensor group)."""
    grad = p.grad
    if grad is None or not is_dtensor(grad):
        return grad
    if tuple(grad.placements) != tuple(p.placements):
        grad = grad.redistribute(p.device_mesh, p.placements)
        p.grad = grad
    return grad._local_tensor


def set_local_grad(p: torch.Tensor, local: torch.Tensor | None) -> None:
    """Point a parameter's `.grad` at `local` (a view of the engine's buffer): as a
    DTensor of the parameter's placement for a DTensor parameter, so that autograd keeps
    accumulating into the same memory."""
    if local is None or not is_dtensor(p):
        p.grad = local
        return
    p.grad = DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def full_tensor(local: torch.Tensor, placement: TensorPlacement, tensor_group) -> torch.Tensor:
    """The whole parameter in CPU memory, from each position's block of it (collective
    over the tensor-parallel group: each position broadcasts its block in turn)."""
    out = torch.empty(placement.full_shape, dtype=local.dtype)
    for position in range(placement.size):
        starts, shape = placement.block(position)
        if position == placement.position:
            block = local.contiguous()
        else:
            block = torch.empty(shape, dtype=local.dtype, device=local.device)
        tensor_group.broadcast(block, src=position, kind="gathered")
        out[tuple(slice(a, a + n) for a, n in zip(starts, shape))] = block.cpu()
    return out


# ---------------------------------------------------------------------------- the mesh
def tensor_parallel_mesh(
    tensor_parallel_size: int,
    world_size: int,
    device: torch.device,
    names: tuple[str, str] = ("data_parallel", "tensor_parallel"),
):
    """The (data, tensor) DeviceMesh of contiguous tensor-parallel groups (collective);
    None without tensor parallelism. Named as Lightning's ModelParallelStrategy names
    its own, so a `configure_model` written for it runs unchanged."""
    if tensor_parallel_size == 1:
        return None
    MeshLayout.contiguous(world_size, tensor_parallel_size, 0)  # the size must divide
    from torch.distributed.device_mesh import init_device_mesh

    shape = (world_size // tensor_parallel_size, tensor_parallel_size)
    return init_device_mesh(device.type, shape, mesh_dim_names=names)
