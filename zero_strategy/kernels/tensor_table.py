"""Device tables that let one Triton launch walk many tensors (multi-tensor apply).

Each program instance handles one chunk of one tensor. The host lists, per tensor, the
address of every operand and the element count, and per chunk, which tensor and where it
starts. The engine steps the same tensors every step, so tables are cached by content.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

_CACHE_SIZE = 16
_cache: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = OrderedDict()


def chunk_tables(
    operands: Sequence[Sequence[torch.Tensor]], chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For `operands` (lists of equal length, e.g. params, grads, ...; element counts given
    by the first), return:

    - addresses: int64 [n_operands, n_tensors], data pointers;
    - numels: int64 [n_tensors];
    - chunks: int64 [2, n_chunks], (tensor index, first element) of each chunk.
    """
    first = operands[0]
    device = first[0].device
    numels = [t.numel() for t in first]
    key = (device, chunk, tuple(numels), tuple(t.data_ptr() for ts in operands for t in ts))
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit
    addresses = torch.tensor([[t.data_ptr() for t in ts] for ts in operands], dtype=torch.int64)
    per_tensor = [max(1, -(-n // chunk)) for n in numels]
    owner = torch.repeat_interleave(torch.arange(len(numels)), torch.tensor(per_tensor))
    first_chunk = torch.cumsum(torch.tensor([0, *per_tensor[:-1]]), 0)
    starts = (torch.arange(len(owner)) - first_chunk[owner]) * chunk
    tables = (
        addresses.to(device),
        torch.tensor(numels, dtype=torch.int64).to(device),
        torch.stack([owner, starts]).to(torch.int64).to(device),
    )
    _cache[key] = tables
    if len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return tables
