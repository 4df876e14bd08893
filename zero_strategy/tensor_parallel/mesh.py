"""The world's ranks as a (data, tensor) grid, and the DeviceMesh the frameworks hand
to a `configure_model`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

TENSOR_NAMES = ("tensor", "tp", "tensor_parallel")


@dataclass(frozen=True)
class MeshLayout:
    """The world's ranks as a (data, tensor) grid: `grid[d][t]` is the global rank at
    data-parallel index d and tensor-parallel position t."""

    grid: tuple[tuple[int, ...], ...]
    global_rank: int

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

    @classmethod
    def of_world(cls, device_mesh, tensor_parallel_size: int) -> MeshLayout:
        """This process's world as a grid: the 2-D `device_mesh` given, else contiguous
        tensor groups of `tensor_parallel_size` (one rank without torch.distributed)."""
        import torch.distributed as dist

        running = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if running else (0, 1)
        if device_mesh is None:
            return cls.contiguous(world, tensor_parallel_size, rank)
        layout = cls.from_device_mesh(device_mesh, rank)
        if tensor_parallel_size not in (1, layout.tensor_size):
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} disagrees with the "
                f"device_mesh's tensor dimension ({layout.tensor_size}); set one."
            )
        if layout.world_size != world:
            raise ValueError(
                f"device_mesh covers {layout.world_size} ranks; the world has {world}. "
                "Build the mesh over every rank."
            )
        return layout

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
