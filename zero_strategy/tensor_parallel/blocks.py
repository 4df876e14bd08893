"""Where a tensor-parallel shard sits in its full tensor: checkpoints store the blocks,
loads at another size read the overlapping ones, whole tensors are assembled."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .dtensors import is_dtensor, is_shard, local_tensor

Block = tuple[tuple[int, ...], tuple[int, ...]]  # (starts, shape) in the full tensor


@dataclass(frozen=True)
class TensorPlacement:
    """A DTensor parameter on the tensor-parallel ranks: each of the `size` positions
    holds the block of the full (logical) tensor that its placements give it, and this
    rank holds `position`'s. Shards follow torch.chunk, as DTensor's do: the first
    positions take the larger pieces, the last may be empty.

    The mesh may have several dimensions (`mesh_shape`, positions numbered in its
    row-major order: Transformers puts a `(tp, 1)` mesh under some weights); each
    dimension's placement splits what the ones before it left, as DTensor's do.

    Checkpoints store a sharded parameter's blocks one after another (position order),
    each flattened on its own: a rank's block is then one contiguous range at `offset`,
    written and (at the same tensor-parallel size) read like any parameter's range."""

    full_shape: tuple[int, ...]
    placements: tuple[str, ...]  # "Shard(d)" or "Replicate()", one per mesh dimension
    position: int
    mesh_shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def sharded(self) -> bool:
        return any(s.startswith("Shard") for s in self.placements)

    def block(self, position: int) -> Block:
        starts, shape = [0] * len(self.full_shape), list(self.full_shape)
        for placement, coordinate, count in zip(
            self.placements, _coordinates(position, self.mesh_shape), self.mesh_shape
        ):
            if placement.startswith("Shard"):
                dim = int(placement[len("Shard(") : -1])
                chunk = -(-shape[dim] // count)
                begin = min(coordinate * chunk, shape[dim])
                starts[dim] += begin
                shape[dim] = max(0, min(chunk, shape[dim] - begin))
        return tuple(starts), tuple(shape)

    def blocks(self) -> list[Block]:
        return [self.block(p) for p in range(self.size)]

    @property
    def offset(self) -> int:
        """Where this rank's block starts in the stored (block after block) flattening."""
        return sum(math.prod(shape) for _, shape in self.blocks()[: self.position])


def _coordinates(position: int, mesh_shape: tuple[int, ...]) -> list[int]:
    """A position's coordinates on the mesh (row-major, as its ranks are listed)."""
    out = []
    for count in reversed(mesh_shape):
        position, coordinate = divmod(position, count)
        out.append(coordinate)
    return out[::-1]


def placement_of(p: torch.Tensor) -> TensorPlacement | None:
    """A DTensor parameter's placement on its tensor-parallel mesh; None for a plain
    one."""
    if not is_dtensor(p):
        return None
    names = tuple(
        f"Shard({x.dim % p.dim()})" if is_shard(x) else "Replicate()" for x in p.placements
    )
    mesh = p.device_mesh
    position = mesh.mesh.flatten().tolist().index(mesh.get_rank())
    placed = TensorPlacement(tuple(p.shape), names, position, tuple(mesh.mesh.shape))
    if placed.block(placed.position)[1] != tuple(local_tensor(p).shape):
        raise ValueError(
            f"A DTensor parameter of shape {tuple(p.shape)} with placements {p.placements} "
            f"holds a local shard of shape {tuple(local_tensor(p).shape)}, not torch.chunk's "
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


def broadcast_whole_parameters(
    flat: torch.Tensor, slots, tensor_group, src: int, kind: str = "broadcast"
) -> None:
    """The parameters whole on every position (`slots` not tensor-sharded) in a unit's
    flat buffer take position `src`'s values: one broadcast over the tensor group."""
    whole = [flat[s.offset : s.end] for s in slots if not s.tensor_sharded]
    if not whole:
        return
    values = torch.cat(whole)
    tensor_group.broadcast(values, src=src, kind=kind)
    for piece, value in zip(whole, values.split([w.numel() for w in whole])):
        piece.copy_(value)
