"""Triton multi-tensor sum of squares: one launch over all gradient shards, one fp32
partial per chunk (summed afterwards in a fixed order, so the result is deterministic)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .adamw_triton import _TL_DTYPES
from .backend import interpreting, on_tensor_device
from .tensor_table import chunk_tables


@triton.jit
def _sum_squares_kernel(
    addresses,  # int64 [1, n_tensors]
    numels,
    chunks,  # int64 [2, n_chunks]
    n_chunks,
    partials,  # float32 [n_chunks]
    DTYPE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(chunks + pid)
    start = tl.load(chunks + n_chunks + pid)
    end = tl.minimum(start + CHUNK, tl.load(numels + t))
    ptr = tl.load(addresses + t).to(tl.pointer_type(DTYPE))
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in tl.range(0, end - start, BLOCK):  # a tensor's last chunk: only its blocks
        idx = start + off + tl.arange(0, BLOCK)
        x = tl.load(ptr + idx, mask=idx < end, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(partials + pid, tl.sum(acc, axis=0))


@on_tensor_device
def sum_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all elements of `tensors` (same dtype), as a float32 scalar."""
    block = 1024
    chunk = 16 * block if not interpreting() else 64 * block
    addresses, numels, chunks = chunk_tables([tensors], chunk)
    n_chunks = chunks.shape[1]
    partials = torch.empty(n_chunks, dtype=torch.float32, device=tensors[0].device)
    _sum_squares_kernel[(n_chunks,)](
        addresses,
        numels,
        chunks,
        n_chunks,
        partials,
        DTYPE=_TL_DTYPES[tensors[0].dtype],
        CHUNK=chunk,
        BLOCK=block,
        num_warps=4,
    )
    return partials.sum()
