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

from typing import Protocol

from torch import nn

from ..comm.communicator import Communicator
from ..layout.partition import Stored
from ..layout.shard_spec import ShardSpec
from ..tensor_parallel import is_dtensor
from . import transformers_experts
from .experts import Experts
from .layer import MoE


class ExpertLayer(Protocol):
    """What the engine needs of an expert-parallel layer (a `MoE`, or a Transformers
    experts module converted by `transformers_experts`)."""

    ep_size: int | None
    num_experts: int
    num_local: int

    def bind(self, comm: Communicator) -> None: ...

    def stored_expert(self, local_name: str, ep_rank: int, shape: tuple[int, ...]) -> Stored: ...


def expert_layers(model: nn.Module) -> dict[str, ExpertLayer]:
    """By the path of the module holding the experts' parameters."""
    layers: dict[str, ExpertLayer] = {
        (f"{path}.experts" if path else "experts"): m
        for path, m in model.named_modules()
        if isinstance(m, MoE)
    }
    layers.update(transformers_experts.converted(model))
    return layers


def settle_expert_parallel(
    model: nn.Module, ep_size: int, rank: int, world_size: int
) -> dict[int, nn.Parameter | None]:
    """Split the experts the configured size decides over `ep_size` ranks (MoE layers
    built with ep_size=None; Transformers experts modules when it is above 1), keeping
    this rank's; returns, by id of each parameter that left the model, its replacement
    (this rank's slice) or None. With `ep_size` above 1, a model with experts in a layout
    that cannot be split is refused by name, never left replicated."""
    if world_size % ep_size:
        raise ValueError(
            f"ZeroConfig.expert_parallel_size={ep_size} does not divide the data-parallel "
            f"world size {world_size}: expert-parallel groups are that many contiguous "
            f"data-parallel ranks (with tensor parallelism, at one tensor position). Use a "
            f"divisor of {world_size}."
        )
    if ep_size > 1:
        _refuse_batched_experts_split_by_tensor_parallelism(model)
    replaced: dict[int, nn.Parameter | None] = {}
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        replaced.update(layer.settle_ep_size(ep_size, rank % ep_size))
    if ep_size == 1:
        return replaced
    for path, module in transformers_experts.convertible(model).items():
        replaced.update(transformers_experts.convert(path, module, ep_size, rank % ep_size))
    known = list(expert_layers(model))
    unknown = transformers_experts.unconvertible(model, known)
    if unknown or not known:
        found = (
            f"expert modules {unknown[:5]} that cannot be split"
            if unknown
            else "no expert layers that can be split"
        )
        raise ValueError(
            f"ZeroConfig.expert_parallel_size={ep_size}, but {type(model).__name__} has "
            f"{found}: expert parallelism takes zero_strategy.moe.MoE "
            "layers and Transformers experts modules with 3-D weights "
            "(@use_experts_implementation). Use expert_parallel_size=1, which shards every "
            "weight, experts included, with ZeRO."
        )
    return replaced


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every module holding experts' weights, by path, before expert parallelism splits
    them: each `MoE` layer's `experts`, and each Transformers experts module (3-D weights)
    not converted yet."""
    own = {
        (f"{path}.experts" if path else "experts"): m.experts
        for path, m in model.named_modules()
        if isinstance(m, MoE)
    }
    return own | transformers_experts.convertible(model)


def _refuse_batched_experts_split_by_tensor_parallelism(model: nn.Module) -> None:
    """Expert parallelism splits a batched weight (several experts in one tensor) by
    rows, and stores those rows in checkpoints; a weight tensor parallelism split too
    would need both layouts at once. One expert's own weights split by the plan are fine
    (each stays one expert's)."""
    for path, module in expert_modules(model).items():
        if isinstance(module, Experts) and not module.batched:  # one module an expert
            continue
        for name, param in module.named_parameters():
            if is_dtensor(param):
                raise ValueError(
                    f"'{path}.{name}' holds several experts in one weight and is split by "
                    "tensor parallelism, so expert parallelism cannot split it by experts. "
                    "Leave these experts out of the tensor-parallel plan (expert "
                    "parallelism splits them), or use expert_parallel_size=1."
                )


def _check(path: str, layer: ExpertLayer, world_size: int) -> None:
    if world_size % layer.ep_size:
        raise ValueError(
            f"MoE layer '{path}' has ep_size={layer.ep_size}, which does not divide the "
            f"data-parallel world size {world_size}: expert-parallel groups are ep_size "
            f"contiguous data-parallel ranks. Use a divisor of {world_size}."
        )


def expert_parallel_partition(ep_size: int, world_size: int) -> tuple[tuple[int, ...], ...]:
    return ShardSpec.contiguous(world_size, ep_size).groups


def expert_placements(layers: dict[str, ExpertLayer], world_size: int) -> dict[str, ShardSpec]:
    """Each experts module -> its expert-data-parallel spec, for layers with ep_size > 1
    (with one expert-parallel rank the experts are ordinary parameters)."""
    out = {}
    for path, layer in layers.items():
        _check(path, layer, world_size)
        if layer.ep_size > 1:
            out[path] = ShardSpec.strided(world_size, world_size // layer.ep_size, replicated=False)
    return out


class ExpertNames:
    """How expert parameters are stored: by global expert id, whichever expert-parallel
    rank holds them (`ExpertLayer.stored_expert`)."""

    def __init__(self, layers: dict[str, ExpertLayer]):
        self.prefixes = {
            (f"{path}." if path else ""): layer
            for path, layer in layers.items()
            if layer.ep_size > 1
        }

    def stored(self, name: str, ep_rank: int, shape: tuple[int, ...]) -> Stored:
        for prefix, layer in self.prefixes.items():
            if name.startswith(prefix):
                local = layer.stored_expert(name[len(prefix) :], ep_rank, tuple(shape))
                return Stored(prefix + local.name, local.shape, local.offset)
        return Stored(name, tuple(shape))
