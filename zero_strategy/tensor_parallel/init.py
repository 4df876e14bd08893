"""Initialising a meta-built tensor-parallel model as it would be without the plan."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from .blocks import TensorPlacement


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
