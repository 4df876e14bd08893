"""What one stage-3 training step sends over the link between nodes: the bytes a rank
receives from ranks of other nodes, by hop, predicted from the units' sizes alone and
equal to `comm_report()`'s `across_node_bytes` (tests/test_two_level.py).

One step is one forward and one backward of every unit, gradients reduced once: the root
unit is gathered once (it stays gathered from forward to backward), every other unit twice
(forward and backward), or, with a kept column (`secondary_partition_size` > 1), its
backward gather stays within the node. Persistent units and `max_reuse_distance` are not
modelled (both default off).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..comm.quantize import packed_bytes
from ..layout.shard_spec import ShardSpec
from .planner import _DTYPE_BYTES


@dataclass(frozen=True)
class LinkSetup:
    """How the data-parallel world meets the link."""

    world_size: int
    ranks_per_node: int  # as the launcher places them (torchrun's --nproc-per-node)
    secondary_partition_size: int = 1
    quantized_weights: bool = False
    quantized_gradients: bool = False
    compute_dtype: str = "fp32"
    reduce_dtype: str | None = None  # default: the compute dtype

    def _elsewhere(self, group: tuple[int, ...], rank: int) -> int:
        """Members of `group` on another node than `rank`."""
        return sum(r // self.ranks_per_node != rank // self.ranks_per_node for r in group)

    def _groups(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """This rank's within-node and across-node hop groups (the world and a single
        rank without a hierarchy: one hop, over the world)."""
        nodes = ShardSpec.contiguous(self.world_size, self.secondary_partition_size)
        node = next(g for g in nodes.groups if rank in g)
        across = next(g for g in nodes.replica_groups() if rank in g)
        return node, across

    def unit_bytes(self, padded_numel: int, gathers: int, rank: int = 0) -> dict[str, int]:
        """Across-node bytes of one unit: `gathers` gathers and one gradient reduction.
        Without a hierarchy the across-node hop is the whole world's flat collective."""
        node, across = self._groups(rank)
        if self._elsewhere(node, rank):
            raise ValueError(
                f"secondary_partition_size={self.secondary_partition_size} spans nodes of "
                f"{self.ranks_per_node} ranks; use a divisor of the ranks per node."
            )
        others = self._elsewhere(across, rank)
        chunk = padded_numel // self.world_size
        gather_bytes = _DTYPE_BYTES[self.compute_dtype]
        reduce_bytes = _DTYPE_BYTES[self.reduce_dtype or self.compute_dtype]
        sent = packed_bytes(chunk) if self.quantized_weights else chunk * gather_bytes
        reduced = packed_bytes(chunk) if self.quantized_gradients else chunk * reduce_bytes
        across_hops = 1 if self.secondary_partition_size > 1 else gathers
        return {"gather": across_hops * others * sent, "reduce": others * reduced}

    def step_bytes(self, unit_numels: list[int], rank: int = 0) -> dict[str, int]:
        """One training step over units of these padded sizes (the root first)."""
        total = {"gather": 0, "reduce": 0}
        for index, numel in enumerate(unit_numels):
            for hop, value in self.unit_bytes(numel, 1 if index == 0 else 2, rank).items():
                total[hop] += value
        return total


def padded_unit_numels(model: nn.Module, world_size: int) -> list[int]:
    """The padded element counts of `model`'s stage-3 units over `world_size` ranks, the
    root first (what the engine builds with its default unit choice)."""
    from ..layout.partition import module_layouts, select_unit_modules, unique_parameters

    world = ShardSpec.world(world_size)
    layouts = module_layouts(
        model, unique_parameters(model), {}, select_unit_modules(model, []), lambda _p: world
    )
    return [layout.padded_numel for layout in layouts]
