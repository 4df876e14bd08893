"""Triton multi-tensor Adam/AdamW: one pass reads param, grad, exp_avg, exp_avg_sq and
writes param, exp_avg, exp_avg_sq (and the low-precision compute copy): 28-30 bytes per
element, the bandwidth floor of an Adam step.

Imported on first use (see backend.py). Per-step scalars that may live on the device (step
size, bias correction, gradient scale, skip flag) are read from a small float32 tensor, so
nothing here waits for the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .backend import interpreting, on_tensor_device
from .tensor_table import chunk_tables

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _adam_chunk_kernel(
    addresses,  # int64 [5, n_tensors]: param, grad, exp_avg, exp_avg_sq, compute copy
    numels,  # int64 [n_tensors]
    chunks,  # int64 [2, n_chunks]: tensor index, first element
    n_tensors,
    n_chunks,
    coeffs,  # float32 [4]: step_size, sqrt(bias_correction2), grad scale, skip
    decay,  # AdamW: 1 - lr * weight_decay
    weight_decay,  # Adam (L2): added to the gradient
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    eps,
    GRAD_DTYPE: tl.constexpr,
    COPY_DTYPE: tl.constexpr,
    ADAMW: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    WRITE_COPY: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(chunks + pid)
    start = tl.load(chunks + n_chunks + pid)
    numel = tl.load(numels + t)
    p_ptr = tl.load(addresses + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(addresses + n_tensors + t).to(tl.pointer_type(GRAD_DTYPE))
    m_ptr = tl.load(addresses + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(addresses + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))
    step_size = tl.load(coeffs)
    bc2_sqrt = tl.load(coeffs + 1)
    scale = tl.load(coeffs + 2)
    skip = tl.load(coeffs + 3)
    # A skipped step (overflow flag set on the device) runs no block; a tensor's last chunk
    # runs only the blocks it fills.
    end = tl.where(skip == 0.0, tl.minimum(start + CHUNK, numel), start)
    for off in tl.range(0, end - start, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < end
        p = tl.load(p_ptr + idx, mask=mask, other=0.0)
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32) * scale
        m = tl.load(m_ptr + idx, mask=mask, other=0.0)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0)
        if MAXIMIZE:
            g = -g
        if ADAMW:
            p = p * decay
        else:
            g = g + weight_decay * p
        m = m + one_minus_beta1 * (g - m)  # torch's lerp for weights below 0.5
        v = v * beta2 + one_minus_beta2 * g * g
        # IEEE-rounded sqrt and division, as torch's kernels use.
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
        tl.store(p_ptr + idx, p, mask=mask)
        tl.store(m_ptr + idx, m, mask=mask)
        tl.store(v_ptr + idx, v, mask=mask)
        if WRITE_COPY:
            c_ptr = tl.load(addresses + 4 * n_tensors + t).to(tl.pointer_type(COPY_DTYPE))
            tl.store(c_ptr + idx, p.to(COPY_DTYPE), mask=mask)


@on_tensor_device
def launch(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    copies: Sequence[torch.Tensor] | None,
    coeffs: torch.Tensor,
    *,
    decay: float,
    weight_decay: float,
    beta2: float,
    one_minus_beta1: float,
    one_minus_beta2: float,
    eps: float,
    adamw: bool,
    maximize: bool,
) -> None:
    """One launch over tensors sharing a gradient dtype and a compute-copy dtype."""
    # The interpreter runs programs one by one: fewer, larger chunks are much faster there.
    block = 1024
    chunk = 16 * block if not interpreting() else 64 * block
    operands = [params, grads, exp_avgs, exp_avg_sqs, copies if copies is not None else params]
    addresses, numels, chunks = chunk_tables(operands, chunk)
    n_chunks = chunks.shape[1]
    copy_dtype = copies[0].dtype if copies is not None else torch.float32
    _adam_chunk_kernel[(n_chunks,)](
        addresses,
        numels,
        chunks,
        len(params),
        n_chunks,
        coeffs,
        decay,
        weight_decay,
        beta2,
        one_minus_beta1,
        one_minus_beta2,
        eps,
        GRAD_DTYPE=_TL_DTYPES[grads[0].dtype],
        COPY_DTYPE=_TL_DTYPES[copy_dtype],
        ADAMW=adamw,
        MAXIMIZE=maximize,
        WRITE_COPY=copies is not None,
        CHUNK=chunk,
        BLOCK=block,
        num_warps=4,
    )
