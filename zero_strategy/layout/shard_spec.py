"""Placement: which ranks shard which module's parameters.

A placement function, in the spirit of FSDP2's `shard_placement_fn`, is asked once per
module, `placement(module_path, module)`, on every rank, and returns a `ShardSpec` for the
modules whose parameters are not sharded over the whole data-parallel world (None for the
rest). A module with a spec shards every parameter under it, unless a deeper module says
otherwise; at stage 3 it becomes a unit of its own, so a unit never mixes groups.

A `ShardSpec` splits the world's ranks into equal groups, each sharding its own copy of
the module's parameters across its ranks. Replicated copies (the default) are kept equal:
gradients are summed across them, as in hybrid sharding. Distinct copies
(`replicated=False`) are different parameters under the same local names, as the local
experts of each expert-parallel rank are: each group reduces and steps its own. The
world itself is the spec with one group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ShardSpec:
    """The world's ranks split into equal groups, each sharding one copy."""

    groups: tuple[tuple[int, ...], ...]
    replicated: bool = True  # copies hold the same parameters (False: each group its own)

    def __post_init__(self) -> None:
        # A group is a set: positions follow rank order (as torch's process groups do),
        # and copies are numbered by their first rank.
        groups = sorted(tuple(sorted(int(r) for r in g)) for g in self.groups)
        object.__setattr__(self, "groups", tuple(groups))

    @classmethod
    def world(cls, world_size: int) -> ShardSpec:
        return cls((tuple(range(world_size)),))

    @classmethod
    def contiguous(cls, world_size: int, group_size: int, replicated: bool = True) -> ShardSpec:
        """Groups of `group_size` consecutive ranks: (0..k-1), (k..2k-1), ..."""
        _check_divides(group_size, world_size)
        starts = range(0, world_size, group_size)
        return cls(tuple(tuple(range(s, s + group_size)) for s in starts), replicated)

    @classmethod
    def strided(cls, world_size: int, group_size: int, replicated: bool = True) -> ShardSpec:
        """Groups of `group_size` ranks a stride apart: (0, s, 2s, ...), (1, 1+s, ...), with
        s = world_size / group_size (the expert-data-parallel groups of contiguous
        expert-parallel groups)."""
        _check_divides(group_size, world_size)
        stride = world_size // group_size
        return cls(tuple(tuple(range(s, world_size, stride)) for s in range(stride)), replicated)

    @property
    def size(self) -> int:
        """Ranks per group: the number of shards of each copy."""
        return len(self.groups[0])

    @property
    def copies(self) -> int:
        return len(self.groups)

    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """The ranks holding the same shard of every copy: position i of each group."""
        return tuple(tuple(g[i] for g in self.groups) for i in range(self.size))

    def locate(self, rank: int) -> tuple[int, int]:
        """(copy index, position in its group) of a global rank."""
        for copy, group in enumerate(self.groups):
            if rank in group:
                return copy, group.index(rank)
        raise ValueError(f"rank {rank} is in no group of {self}")

    def check(self, world_size: int, where: str) -> None:
        """Raise, naming `where`, unless the groups split 0..world_size-1 evenly."""
        ranks = sorted(r for g in self.groups for r in g)
        sizes = {len(g) for g in self.groups}
        if ranks != list(range(world_size)) or len(sizes) != 1:
            raise ValueError(
                f"{where} returned ShardSpec(groups={[list(g) for g in self.groups]}), which "
                f"does not split the {world_size} ranks into groups of equal size, each rank "
                "in exactly one. Use e.g. ShardSpec.contiguous(world_size, group_size)."
            )
        if any(list(r) != sorted(r) for r in self.replica_groups()):
            raise ValueError(
                f"{where} returned ShardSpec(groups={self.describe()}): the ranks holding the "
                "same shard of each copy must rise from copy to copy (copy 0 holds the lowest "
                "ranks at every position). Use ShardSpec.contiguous or ShardSpec.strided."
            )

    def describe(self) -> list[list[int]]:
        return [list(g) for g in self.groups]


def _check_divides(group_size: int, world_size: int) -> None:
    if group_size <= 0 or world_size % group_size:
        raise ValueError(
            f"A shard group size of {group_size} does not divide the world size "
            f"{world_size}; use a divisor of {world_size}."
        )


PlacementFn = Callable[[str, nn.Module], ShardSpec | None]


def placed_modules(
    model: nn.Module, placement: PlacementFn | None, world_size: int
) -> dict[str, ShardSpec]:
    """module path -> its spec, for every module the placement function places (checked);
    a spec equal to the whole world is no placement at all."""
    if placement is None:
        return {}
    world = ShardSpec.world(world_size)
    out: dict[str, ShardSpec] = {}
    for path, module in model.named_modules():
        spec = placement(path, module)
        if spec is None:
            continue
        if not isinstance(spec, ShardSpec):
            raise TypeError(
                f"placement({path!r}, {type(module).__name__}) returned "
                f"{type(spec).__name__}; return a ShardSpec, or None for the whole world."
            )
        spec.check(world_size, f"placement({path!r}, {type(module).__name__})")
        if not spec.replicated:
            raise ValueError(
                f"placement({path!r}, {type(module).__name__}) returned a ShardSpec with "
                "replicated=False: distinct copies need a global name for each copy's "
                "parameters, which only MoE layers give (their experts are placed by the "
                "engine). Return a replicated ShardSpec."
            )
        if spec != world:
            out[path] = spec
    return out


def spec_of_owner(owner_path: str, placed: dict[str, ShardSpec]) -> str | None:
    """The placed module (deepest) whose spec governs parameters owned by `owner_path`."""
    best = None
    for path in placed:
        if within(owner_path, path) and (best is None or len(path) > len(best)):
            best = path
    return best


def owner_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def within(path: str, ancestor: str) -> bool:
    """Whether module `path` is `ancestor` or inside it (the root, "", holds every one)."""
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def placed_path_of_names(names: Sequence[str], placed: dict[str, ShardSpec]) -> str | None:
    """The placed module governing a parameter reachable under `names` (tied weights); an
    error when its names fall under different specs, since one tensor has one layout."""
    paths = {spec_of_owner(owner_of(n), placed) for n in names}
    specs = {placed[p] if p is not None else None for p in paths}
    if len(specs) > 1:
        raise ValueError(
            f"Parameter {names[0]!r} is shared by modules placed on different shard groups "
            f"({sorted(str(p) for p in paths)}); a tensor is sharded one way. Place the "
            "modules that share it on the same ShardSpec (or place their common parent)."
        )
    return paths.pop()
