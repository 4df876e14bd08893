"""Block-wise int8 quantization of what crosses a slow link (ZeRO++'s qwZ and qgZ).

A vector is cut into blocks of `BLOCK` elements; each block is sent as int8 values and one
fp32 scale (its largest magnitude / 127), packed into one byte buffer so that a single
collective carries both: 1 + 4/BLOCK bytes per element instead of 4 (fp32) or 2 (bf16).
Rounding is to nearest, so the error of an element is at most half its block's step.
Only transient copies are quantized (gathered compute weights, gradients in flight):
the fp32 masters and the optimizer's state never are.
"""

from __future__ import annotations

import torch

BLOCK = 256
_SCALE_BYTES = 4


def packed_bytes(numel: int) -> int:
    """Bytes of `numel` elements packed: values padded to whole blocks, then scales."""
    blocks = -(-numel // BLOCK)
    return blocks * BLOCK + blocks * _SCALE_BYTES


def quantize(rows: torch.Tensor) -> torch.Tensor:
    """(R, n) floats -> (R, packed_bytes(n)) uint8: each row's int8 blocks, then its
    fp32 scales."""
    count, n = rows.shape
    blocks = -(-n // BLOCK)
    padded = rows.new_zeros(count, blocks * BLOCK, dtype=torch.float32)
    padded[:, :n] = rows
    padded = padded.view(count, blocks, BLOCK)
    scales = padded.abs().amax(dim=2, keepdim=True).div_(127.0)
    steps = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(padded / steps).clamp_(-127, 127).to(torch.int8)
    out = torch.empty(count, packed_bytes(n), dtype=torch.uint8, device=rows.device)
    out[:, : blocks * BLOCK] = values.view(count, -1).view(torch.uint8)
    out[:, blocks * BLOCK :] = scales.view(count, blocks).view(torch.uint8)
    return out


def dequantize(packed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """(R, packed_bytes(n)) uint8 -> (R, n) of `dtype`: the inverse of `quantize`, up to
    its rounding."""
    count = packed.shape[0]
    blocks = -(-n // BLOCK)
    values = packed[:, : blocks * BLOCK].contiguous().view(torch.int8)
    scales = packed[:, blocks * BLOCK :].contiguous().view(torch.float32)
    full = values.view(count, blocks, BLOCK).to(torch.float32) * scales.view(count, blocks, 1)
    return full.view(count, -1)[:, :n].to(dtype)
