"""Triton kernels for MoE routing: top-k gate, per-expert positions, row scatter/gather.

Imported on first use (see backend.py). Every kernel accumulates in fp32 and keeps the
reference's tie rule (the lower expert index wins) and priority order (all first choices,
then all second choices, each in token order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import on_tensor_device


@triton.jit
def _topk_softmax_kernel(
    logits,  # [T, E]
    weights_out,  # float32 [T, K]
    index_out,  # int64 [T, K]
    E,
    K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # t * E may pass 2**31
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    x = tl.load(logits + t * E + cols, mask=valid, other=-float("inf")).to(tl.float32)
    x_max = tl.max(x, axis=0)
    num = tl.where(valid, tl.exp(x - x_max), 0.0)
    probs = num / tl.sum(num, axis=0)
    remaining = tl.where(valid, probs, -1.0)
    total = 0.0
    for j in tl.static_range(K):
        best = tl.max(remaining, axis=0)
        # Lowest index among the maxima: ties go to the lower expert.
        idx = tl.min(tl.where(remaining == best, cols, BLOCK_E), axis=0)
        tl.store(index_out + t * K + j, idx.to(tl.int64))
        tl.store(weights_out + t * K + j, best)
        total += best
        remaining = tl.where(cols == idx, -1.0, remaining)
    if NORMALIZE:
        for j in tl.static_range(K):
            w = tl.load(weights_out + t * K + j)
            tl.store(weights_out + t * K + j, w / total)


@on_tensor_device
def topk_softmax(logits: torch.Tensor, k: int, normalize: bool):
    tokens, experts = logits.shape
    weights = torch.empty(tokens, k, dtype=torch.float32, device=logits.device)
    index = torch.empty(tokens, k, dtype=torch.int64, device=logits.device)
    if tokens:
        _topk_softmax_kernel[(tokens,)](
            logits.contiguous(),
            weights,
            index,
            experts,
            K=k,
            NORMALIZE=normalize,
            BLOCK_E=triton.next_power_of_2(experts),
        )
    return weights, index


@triton.jit
def _expert_positions_kernel(
    expert_index,  # int64 [T, K], read in slot-major order
    position_out,  # int64 [T, K]
    counts_out,  # int64 [E]
    T,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per expert: a running prefix count over the assignments in priority
    order (flat index f = slot * T + token)."""
    e = tl.program_id(0)
    n = T * K
    running = tl.zeros([], dtype=tl.int64)
    for start in tl.range(0, n, BLOCK):
        f = start + tl.arange(0, BLOCK)
        inside = f < n
        addr = (f % T) * K + f // T
        hit = (tl.load(expert_index + addr, mask=inside, other=-1) == e) & inside
        ones = hit.to(tl.int64)
        pos = running + tl.cumsum(ones, axis=0) - 1
        tl.store(position_out + addr, pos, mask=hit)
        running += tl.sum(ones, axis=0)
    tl.store(counts_out + e, running)


@on_tensor_device
def expert_positions(expert_index: torch.Tensor, num_experts: int):
    tokens, k = expert_index.shape
    position = torch.empty_like(expert_index, dtype=torch.int64)
    counts = torch.empty(num_experts, dtype=torch.int64, device=expert_index.device)
    _expert_positions_kernel[(num_experts,)](
        expert_index.contiguous(), position, counts, tokens, K=k, BLOCK=1024
    )
    return position, counts


@triton.jit
def _scatter_rows_kernel(
    x,  # [T, H]
    rows,  # int64 [T * K]: destination row, -1 = dropped
    weights,  # float32 [T * K] (read only if HAS_WEIGHTS)
    out,  # [R, H]
    H,
    K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    a = tl.program_id(0).to(tl.int64)  # (a // K) * H may pass 2**31
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row = tl.load(rows + a)
    mask = cols < tl.where(row >= 0, H, 0)  # a dropped assignment (-1) copies nothing
    vals = tl.load(x + (a // K) * H + cols, mask=mask, other=0.0)
    if HAS_WEIGHTS:
        vals = (vals.to(tl.float32) * tl.load(weights + a)).to(vals.dtype)
    tl.store(out + row * H + cols, vals, mask=mask)


@triton.jit
def _gather_rows_kernel(
    y,  # [R, H]
    rows,  # int64 [T * K]
    weights,  # float32 [T * K] (read only if HAS_WEIGHTS)
    out,  # [T, H]
    H,
    K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # t * H may pass 2**31
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(rows + t * K + j)
        vals = tl.load(y + row * H + cols, mask=cols < tl.where(row >= 0, H, 0), other=0.0)
        if HAS_WEIGHTS:
            acc += vals.to(tl.float32) * tl.load(weights + t * K + j)
        else:
            acc += vals.to(tl.float32)
    tl.store(out + t * H + cols, acc.to(out.dtype.element_ty), mask=cols < H)


@triton.jit
def _row_dot_kernel(
    grad,  # [T, H]
    y,  # [R, H]
    rows,  # int64 [T * K]
    out,  # float32 [T * K]
    H,
    K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    a = tl.program_id(0).to(tl.int64)
    row = tl.load(rows + a)
    limit = tl.where(row >= 0, H, 0)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in tl.range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        mask = cols < limit
        g = tl.load(grad + (a // K) * H + cols, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(y + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        acc += g * v
    tl.store(out + a, tl.sum(acc, axis=0))


def _block_h(hidden: int) -> int:
    return min(1024, triton.next_power_of_2(max(hidden, 1)))


def _move_rows(kernel, programs: int, src, rows, weights, out) -> None:
    """Launch a row kernel over `programs` rows x hidden blocks (nothing when empty)."""
    hidden = src.shape[1]
    if programs and hidden:
        block = _block_h(hidden)
        kernel[(programs, triton.cdiv(hidden, block))](
            src.contiguous(),
            rows.contiguous(),
            weights.contiguous() if weights is not None else rows,
            out,
            hidden,
            K=rows.shape[1],
            HAS_WEIGHTS=weights is not None,
            BLOCK_H=block,
        )


@on_tensor_device
def scatter_rows(x, rows, weights, num_rows: int, zero_fill: bool):
    """out[rows[t, j]] = x[t] (* weights[t, j]); rows of -1 are skipped."""
    alloc = torch.zeros if zero_fill else torch.empty
    out = alloc(num_rows, x.shape[1], dtype=x.dtype, device=x.device)
    _move_rows(_scatter_rows_kernel, rows.numel(), x, rows, weights, out)
    return out


@on_tensor_device
def gather_rows(y, rows, weights):
    """out[t] = sum_j y[rows[t, j]] (* weights[t, j]); rows of -1 contribute nothing."""
    out = torch.empty(rows.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
    _move_rows(_gather_rows_kernel, rows.shape[0], y, rows, weights, out)
    return out


@on_tensor_device
def row_dot(grad, y, rows):
    tokens, k = rows.shape
    hidden = grad.shape[1]
    out = torch.zeros(tokens, k, dtype=torch.float32, device=grad.device)
    if tokens * k and hidden:
        _row_dot_kernel[(tokens * k,)](
            grad.contiguous(),
            y.contiguous(),
            rows.contiguous(),
            out,
            hidden,
            K=k,
            BLOCK_H=_block_h(hidden),
        )
    return out
