"""Which assignments each expert takes: all of them (dropless), or at most a capacity,
first choices before second choices and, within a choice, tokens in order (GShard's and
DeepSpeed-MoE's priority) or in random order (random token selection, top-1).

Kept rows are packed per expert with no padding, so the all-to-all moves only real rows
and an expert's row count is its split size: capacity bounds the work, it is not a
buffer shape."""

from __future__ import annotations

import math

import torch

from ..kernels import DispatchPlan, plan_dispatch


def capacity_for(tokens: int, k: int, num_experts: int, factor: float, min_capacity: int) -> int:
    """ceil(tokens * k / num_experts * factor), at least `min_capacity` (DeepSpeed-MoE's
    rule; top-2 doubles it as DeepSpeed's does, through k)."""
    return max(min_capacity, math.ceil(tokens * k / num_experts * factor))


def plan(
    expert_index: torch.Tensor,
    num_experts: int,
    capacity: int | None,
    shuffle: torch.Generator | None = None,
) -> DispatchPlan:
    """The dispatch plan; with `shuffle`, tokens compete for capacity in a random order."""
    if capacity is None:
        return plan_dispatch(expert_index, num_experts)  # dropless: packed already
    order = None
    if shuffle is not None and expert_index.shape[0]:
        order = torch.randperm(expert_index.shape[0], generator=shuffle).to(expert_index.device)
        expert_index = expert_index[order]
    padded = plan_dispatch(expert_index, num_experts, capacity)
    position = padded.position
    if order is not None:  # back to token order
        restore = torch.empty_like(order)
        restore[order] = torch.arange(order.numel(), device=order.device)
        expert_index, position = expert_index[restore], position[restore]
    kept = padded.kept_per_expert
    offsets = torch.cumsum(kept, 0) - kept
    keep = position < capacity
    rows = torch.where(keep, offsets[expert_index] + position, -1)
    return DispatchPlan(
        expert_index,
        position,
        padded.tokens_per_expert,
        kept,
        rows,
        int(kept.sum()),
        None,  # packed: every row of the buffer is written
    )
