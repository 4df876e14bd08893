"""Token dispatch across the expert-parallel group: rows grouped by global expert go to
the rank holding that expert, by one all-to-all with uneven splits, and come back by
another. A rank or an expert with no token still takes part, with empty splits, so the
collectives pair up whatever the routing.

Under `torch.compile` both exchanges, and the regrouping between them, run eagerly, each a
graph break where it is called: their splits come from the routing's data (Python ints a
graph cannot hold), and the communicator's byte counters they update would otherwise be
traced, guarded on (a recompile when they change) and refused inside the autograd
Function (a break of its own). They are made eager-only when a layer is bound to its
group (`keep_exchanges_out_of_graphs`, before any forward), not at import:
module_hooks.py says why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..comm.communicator import Communicator


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: backward sends the gradients back the way rows came."""

    @staticmethod
    def forward(ctx, rows, comm: Communicator, output_splits: list[int], input_splits: list[int]):
        ctx.comm, ctx.output_splits, ctx.input_splits = comm, output_splits, input_splits
        return comm.all_to_all(rows, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        back = ctx.comm.all_to_all(grad.contiguous(), ctx.input_splits, ctx.output_splits)
        return back, None, None, None


def exchange(
    rows: torch.Tensor, per_expert: torch.Tensor, comm: Communicator, num_local: int
) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
    """Send `rows` (grouped by global expert, `per_expert[e]` rows for expert e) to the
    ranks holding the experts. Returns the rows received (grouped by source rank, then
    local expert), the splits to send results back with, and received counts
    [source rank, local expert]."""
    return _Exchanges.exchange(rows, per_expert, comm, num_local)


def _exchange(rows, per_expert, comm, num_local):
    size = comm.size
    sent = per_expert.reshape(size, num_local)
    counts = comm.all_to_all(
        sent.to(torch.int64).reshape(-1), [num_local] * size, [num_local] * size
    )
    received = counts.reshape(size, num_local)
    input_splits = sent.sum(1).tolist()
    output_splits = received.sum(1).tolist()
    out = _AllToAll.apply(rows, comm, output_splits, input_splits)
    return out, output_splits, input_splits, received


def combine(
    rows: torch.Tensor, comm: Communicator, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    """The expert outputs back to the ranks their tokens came from (`exchange` reversed)."""
    return _Exchanges.combine(rows, comm, input_splits, output_splits)


def by_expert(
    rows: torch.Tensor, received: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Regroup rows ordered (source, local expert) into one chunk per local expert; also
    the permutation that restores the original order from the concatenated chunks."""
    return _Exchanges.by_expert(rows, received)


def _by_expert(rows, received):
    sources, num_local = received.shape
    counts = received.reshape(-1).tolist()
    starts = torch.tensor([0, *counts[:-1]]).cumsum(0).tolist() if counts else []
    order = []
    for e in range(num_local):
        for s in range(sources):
            i = s * num_local + e
            order.append(torch.arange(starts[i], starts[i] + counts[i]))
    index = torch.cat(order).to(rows.device)  # num_local >= 1: never empty of pieces
    grouped = rows.index_select(0, index)
    per_expert = received.sum(0).tolist()
    return list(grouped.split(per_expert)), index


class _Exchanges:
    """The exchanges (and the regrouping between them, Python bookkeeping over the
    received counts) as called: plain functions until a layer is bound, then the same
    functions disabled for dynamo (one wrapper each for every layer, so dynamo guards on
    no layer's identity)."""

    exchange: Callable = staticmethod(_exchange)
    combine: Callable = staticmethod(_AllToAll.apply)
    by_expert: Callable = staticmethod(_by_expert)


@functools.cache
def keep_exchanges_out_of_graphs() -> None:
    """Make the exchanges and the regrouping run eagerly under torch.compile (called by
    each expert layer's `bind`, outside any compiled region)."""
    _Exchanges.exchange = staticmethod(torch.compiler.disable(_exchange))
    _Exchanges.combine = staticmethod(torch.compiler.disable(_AllToAll.apply))
    _Exchanges.by_expert = staticmethod(torch.compiler.disable(_by_expert))
