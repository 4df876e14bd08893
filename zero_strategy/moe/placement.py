"""What the engine needs to know about a model's MoE layers: their expert-parallel
groups, where their experts are sharded, and the names experts are stored under.

- Expert-parallel groups are contiguous ranks (`ShardSpec.contiguous(world, ep_size)`);
  tokens travel by all-to-all inside one.
- The experts of expert-parallel rank j live on the ranks at position j of every
  expert-parallel group: the expert-data-parallel group (`ShardSpec.strided`), over which
  ZeRO shards them. Each such group holds different experts under the same local names:
  the spec's copies are distinct (`replicated=False`).
- A checkpoint stores an expert under its global id, so it reloads at any `ep_size`.
"""

from __future__ import annotations

import math

from torch import nn

from ..partition import Stored
from ..placement import ShardSpec
from .layer import MoE


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    return {path: m for path, m in model.named_modules() if isinstance(m, MoE)}


def settle_expert_parallel(
    model: nn.Module, ep_size: int, rank: int, world_size: int
) -> dict[int, nn.Parameter | None]:
    """Give layers built with ep_size=None the configured size (1 unless the world is
    split), keeping this rank's experts; returns, by id of each parameter that left the
    model, its replacement (a batched weight's slice) or None."""
    if world_size % ep_size:
        raise ValueError(
            f"ZeroConfig.expert_parallel_size={ep_size} does not divide the world size "
            f"{world_size}: expert-parallel groups are that many contiguous ranks. Use a "
            f"divisor of {world_size}."
        )
    replaced: dict[int, nn.Parameter | None] = {}
    for layer in moe_layers(model).values():
        replaced.update(layer.settle_ep_size(ep_size, rank % ep_size))
    return replaced


def _check(path: str, layer: MoE, world_size: int) -> None:
    if world_size % layer.ep_size:
        raise ValueError(
            f"MoE layer '{path}' has ep_size={layer.ep_size}, which does not divide the "
            f"world size {world_size}: expert-parallel groups are ep_size contiguous ranks. "
            f"Use a divisor of {world_size}."
        )


def expert_parallel_partition(ep_size: int, world_size: int) -> tuple[tuple[int, ...], ...]:
    return ShardSpec.contiguous(world_size, ep_size).groups


def expert_placements(layers: dict[str, MoE], world_size: int) -> dict[str, ShardSpec]:
    """`<layer>.experts` -> its expert-data-parallel spec, for layers with ep_size > 1 (with
    one expert-parallel rank the experts are ordinary parameters)."""
    out = {}
    for path, layer in layers.items():
        _check(path, layer, world_size)
        if layer.ep_size > 1:
            spec = ShardSpec.strided(world_size, world_size // layer.ep_size, replicated=False)
            out[f"{path}.experts" if path else "experts"] = spec
    return out


class ExpertNames:
    """How expert parameters are stored: the local `<layer>.experts.local.<i>.<rest>` of
    expert-parallel rank j as `<layer>.experts.local.<j * num_local + i>.<rest>`; a batched
    weight `[num_local, ...]` as rows `j * num_local ...` of one `[num_experts, ...]`."""

    def __init__(self, layers: dict[str, MoE]):
        self.prefixes = {
            (f"{path}.experts." if path else "experts."): layer
            for path, layer in layers.items()
            if layer.ep_size > 1
        }

    def stored(self, name: str, ep_rank: int, shape: tuple[int, ...]) -> Stored:
        for prefix, layer in self.prefixes.items():
            if name.startswith(prefix):
                stored = prefix + layer.global_expert_name(name[len(prefix) :], ep_rank)
                if not layer.experts.batched:
                    return Stored(stored, tuple(shape))
                rows = math.prod(shape)
                return Stored(stored, (layer.num_experts, *shape[1:]), ep_rank * rows)
        return Stored(name, tuple(shape))
