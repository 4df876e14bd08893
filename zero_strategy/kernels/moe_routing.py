"""MoE token routing: top-k gate, capacity positions, permute and unpermute.

The interface an expert-parallel layer needs, in the order it calls it:

1. ``topk_route(logits, k)``: combine weights and expert ids per token (softmax in fp32;
   on ties the lower expert id wins, so every rank and backend routes identically).
2. ``plan_dispatch(expert_index, num_experts, capacity)``: each assignment's position in
   its expert (first choices before second choices, tokens in order, as GShard and
   DeepSpeed-MoE prioritise), tokens per expert, and the row each assignment goes to in the
   permuted buffer: ``expert * capacity + position`` (fixed-size buffers, assignments past
   capacity dropped) or, with ``capacity=None``, dropless rows grouped by expert, whose
   per-expert counts are the split sizes of an all-to-all.
3. ``permute(x, plan)``: rows of tokens into that buffer (differentiable).
4. ``unpermute(y, plan, weights)``: each token's expert outputs, weighted and summed
   (differentiable in ``y`` and ``weights``).

An expert that receives no token gets zero rows (and, in the capacity layout, zero-filled
rows): it still has its place in the buffer, so collectives over it keep their shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import use_triton


@dataclass(frozen=True)
class DispatchPlan:
    expert_index: torch.Tensor  # int64 [T, k]
    position: torch.Tensor  # int64 [T, k]: rank of the assignment within its expert
    tokens_per_expert: torch.Tensor  # int64 [E]: assignments routed (before capacity)
    kept_per_expert: torch.Tensor  # int64 [E]: rows each expert receives
    rows: torch.Tensor  # int64 [T, k]: row in the permuted buffer, -1 if dropped
    num_rows: int
    capacity: int | None


# ----------------------------------------------------------------------------- gate
def topk_route(
    logits: torch.Tensor, k: int, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert_index int64 [T, k]) from router logits [T, E].
    Weights are the softmax probabilities of the chosen experts, renormalised to sum to 1
    when `normalize` (Mixtral) or left as they are (GShard top-1/top-2)."""
    if logits.dim() != 2:
        raise ValueError(
            f"topk_route: logits must be [tokens, experts], got {tuple(logits.shape)}."
        )
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"topk_route: k={k} must be between 1 and the {logits.shape[1]} experts.")
    if use_triton(logits):
        from . import moe_triton

        return moe_triton.topk_softmax(logits, k, normalize)
    return reference_topk_route(logits, k, normalize)


def reference_topk_route(logits, k, normalize=True):
    probs = torch.softmax(logits.to(torch.float32), dim=-1)
    # A stable descending sort keeps the lower expert first among equal probabilities.
    values, index = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, index = values[:, :k], index[:, :k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, index


# ----------------------------------------------------------------------------- plan
def plan_dispatch(
    expert_index: torch.Tensor, num_experts: int, capacity: int | None = None
) -> DispatchPlan:
    if expert_index.dim() != 2:
        raise ValueError("plan_dispatch: expert_index must be [tokens, k].")
    if capacity is not None and capacity < 0:
        raise ValueError(f"plan_dispatch: capacity={capacity} must be >= 0 (or None: dropless).")
    expert_index = expert_index.to(torch.int64)
    if use_triton(expert_index) and expert_index.numel():
        from . import moe_triton

        position, counts = moe_triton.expert_positions(expert_index, num_experts)
    else:
        position, counts = reference_expert_positions(expert_index, num_experts)
    if capacity is None:
        offsets = torch.cumsum(counts, 0) - counts
        rows = offsets[expert_index] + position
        kept = counts
        num_rows = expert_index.numel()
    else:
        keep = position < capacity
        rows = torch.where(keep, expert_index * capacity + position, -1)
        kept = counts.clamp(max=capacity)
        num_rows = num_experts * capacity
    return DispatchPlan(expert_index, position, counts, kept, rows, num_rows, capacity)


def reference_expert_positions(expert_index: torch.Tensor, num_experts: int):
    tokens, k = expert_index.shape
    priority = expert_index.t().reshape(-1)  # slot-major: all first choices first
    one_hot = torch.nn.functional.one_hot(priority, num_experts)
    before = torch.cumsum(one_hot, 0) - one_hot
    position = before.gather(1, priority[:, None]).squeeze(1)
    counts = one_hot.sum(0)
    return position.reshape(k, tokens).t().contiguous(), counts


# ----------------------------------------------------------------------------- data
def permute(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """[T, H] tokens into [plan.num_rows, H] expert rows (differentiable)."""
    return _Permute.apply(x, plan.rows, plan.num_rows, plan.capacity is not None)


def unpermute(y: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor) -> torch.Tensor:
    """[num_rows, H] expert outputs back to [T, H], each token's rows weighted and summed
    (differentiable in `y` and `weights`)."""
    return _Unpermute.apply(y, plan.rows, weights.to(torch.float32))


def reference_permute(x, rows, num_rows):
    out = x.new_zeros(num_rows, x.shape[1])
    keep = rows.reshape(-1) >= 0
    src = x.repeat_interleave(rows.shape[1], dim=0)[keep]
    return out.index_copy(0, rows.reshape(-1)[keep], src)


def reference_unpermute(y, rows, weights):
    valid = rows >= 0
    picked = y[rows.clamp(min=0)] * (weights * valid).unsqueeze(-1).to(y.dtype)
    return picked.sum(dim=1)


def _scatter(x, rows, weights, num_rows, zero_fill):
    if use_triton(x):
        from . import moe_triton

        return moe_triton.scatter_rows(x, rows, weights, num_rows, zero_fill)
    out = x.new_zeros(num_rows, x.shape[1])
    flat = rows.reshape(-1)
    keep = flat >= 0
    src = x.repeat_interleave(rows.shape[1], dim=0)
    if weights is not None:
        src = (src.to(torch.float32) * weights.reshape(-1, 1)).to(x.dtype)
    return out.index_copy_(0, flat[keep], src[keep])


def _gather(y, rows, weights):
    if use_triton(y):
        from . import moe_triton

        return moe_triton.gather_rows(y, rows, weights)
    valid = (rows >= 0).to(torch.float32)
    w = valid if weights is None else weights * valid
    picked = y[rows.clamp(min=0)].to(torch.float32) * w.unsqueeze(-1)
    return picked.sum(dim=1).to(y.dtype)


def _row_dot(grad, y, rows):
    if use_triton(grad):
        from . import moe_triton

        return moe_triton.row_dot(grad, y, rows)
    valid = (rows >= 0).to(torch.float32)
    picked = y[rows.clamp(min=0)].to(torch.float32)
    return (picked * grad.to(torch.float32).unsqueeze(1)).sum(-1) * valid


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows, num_rows, zero_fill):
        ctx.save_for_backward(rows)
        return _scatter(x, rows, None, num_rows, zero_fill)

    @staticmethod
    def backward(ctx, grad_out):
        (rows,) = ctx.saved_tensors
        return _gather(grad_out.contiguous(), rows, None), None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, rows, weights):
        ctx.save_for_backward(y, rows, weights)
        return _gather(y, rows, weights)

    @staticmethod
    def backward(ctx, grad_out):
        y, rows, weights = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = _scatter(grad_out, rows, weights, y.shape[0], True)
        if ctx.needs_input_grad[2]:
            grad_w = _row_dot(grad_out, y, rows)
        return grad_y, None, grad_w
