"""Global L2 norm of many gradient shards, with a non-finite flag.

Clipping and fp16 loss scaling both need, per step, the sum of squares of every gradient
shard (to be all-reduced across ranks) and whether any element is inf/nan. One fused pass
gives both: a non-finite element makes the sum non-finite.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backend import use_triton


def multi_tensor_sum_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of every element of `tensors`, accumulated in float32, as a scalar
    tensor on their device (zero when the list is empty)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError("multi_tensor_sum_squares: all tensors must be on one device.")
    if not use_triton(*tensors):
        return reference_sum_squares(tensors)
    from . import norm_triton

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("multi_tensor_sum_squares: tensors must be contiguous.")
        by_dtype.setdefault(t.dtype, []).append(t)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group in by_dtype.values():
        total = total + norm_triton.sum_squares(group)
    return total


def reference_sum_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    norms = torch._foreach_norm([t.to(torch.float32) for t in tensors], 2.0)
    return torch.stack(norms).square().sum()


def multi_tensor_l2_norm(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(L2 norm as a float32 scalar, found_inf as a float32 scalar: 1.0 if any element is
    inf or nan, else 0.0). Neither value is brought to the host."""
    sq = multi_tensor_sum_squares(tensors)
    return sq.sqrt(), non_finite_flag(sq)


def non_finite_flag(value: torch.Tensor) -> torch.Tensor:
    """1.0 where `value` is inf or nan, else 0.0 (float32, on its device)."""
    return (~torch.isfinite(value)).to(torch.float32)
