"""`dist.all_reduce(p.grad)` and `dist.broadcast(p.grad, src)` at stages 2-3.

Code written for DDP sometimes synchronises gradients by hand after backward (Lightning's
manual-optimization tests do: `all_reduce(p.grad)`, then divide by the world size). Under
DDP the gradient is already the same on every rank, so the sum is the world size times
it, and a broadcast changes nothing. A sharded gradient (`ShardedGrad`) is that same
value on every rank, so each collective is that arithmetic on this rank's part: no
gradient-sized traffic. One one-element collective of the same kind keeps the ranks in
step (a rank that skips it fails the others' timeout, as the real one would) and gives
`async_op=True` its work handle.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# What a reduction over k ranks that all hold the value x gives.
_SAME_VALUE = {
    dist.ReduceOp.SUM: lambda x, k: x.mul_(k),
    dist.ReduceOp.PRODUCT: lambda x, k: x.pow_(k),
    dist.ReduceOp.MIN: lambda x, k: x,
    dist.ReduceOp.MAX: lambda x, k: x,
    dist.ReduceOp.AVG: lambda x, k: x,
}


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """`dist.all_reduce` of a sharded gradient (the same value on every rank)."""
    change = next((f for known, f in _SAME_VALUE.items() if op == known), None)
    if change is None:
        raise RuntimeError(
            f"all_reduce with {op} of a sharded gradient (p.grad at ZeRO stages 2-3) is "
            "not supported: the gradient is already reduced, the same on every rank. Use "
            "SUM, AVG, MIN, MAX or PRODUCT, or reduce a copy (p.grad.clone())."
        )
    work = dist.all_reduce(torch.zeros(1), op=dist.ReduceOp.SUM, group=group, async_op=True)
    change(tensor, dist.get_world_size(group))
    if async_op:
        return work
    work.wait()
    return None


def broadcast(tensor: torch.Tensor, src=None, group=None, async_op: bool = False, group_src=None):
    """`dist.broadcast` of a sharded gradient: every rank holds the source's value."""
    kwargs = {"src": src} if group_src is None else {"group_src": group_src}
    work = dist.broadcast(torch.zeros(1), group=group, async_op=True, **kwargs)
    if async_op:
        return work
    work.wait()
    return None
