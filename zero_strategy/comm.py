"""Collectives over the data-parallel group, with byte accounting for `comm_report()`.

Every engine collective goes through `Communicator` so that the report is exact. Bytes
are counted as the size of the full (unsharded) tensor a collective is about: the input
of a reduce-scatter or all-reduce, the output of an all-gather. Each is recorded under
the collective actually issued: on gloo, whose reduce-scatter and all-gather are slower
than its all-reduce and broadcast, a reduce-scatter is an all-reduce and an all-gather is
one broadcast per rank (same bytes, counted under "all_reduce" and "broadcast").
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from .topology import DataParallelGroup


class _DoneWork:
    """Stands in for a finished collective on a single process."""

    def wait(self) -> bool:
        return True


class _Works:
    """Several collectives waited on as one."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


class Communicator:
    def __init__(
        self,
        dp: DataParallelGroup,
        reduce_scatter_via_all_reduce: bool,
        all_gather_via_broadcast: bool,
    ):
        self.dp = dp
        self.reduce_scatter_via_all_reduce = reduce_scatter_via_all_reduce
        self.all_gather_via_broadcast = all_gather_via_broadcast
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        self.bytes[kind] += tensor.numel() * tensor.element_size()
        self.calls[kind] += 1

    def report(self) -> dict[str, dict[str, int]]:
        return {k: {"bytes": self.bytes[k], "calls": self.calls[k]} for k in sorted(self.bytes)}

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    # ------------------------------------------------------------------ collectives
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """output (world * shard.numel()) <- every rank's shard, in rank order.

        With `all_gather_via_broadcast`, each rank broadcasts its slice of `output` in
        place: on gloo that moves the same bytes about 3x faster than its all-gather."""
        if not self.dp.distributed:
            self._count("all_gather", output)
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return _DoneWork() if async_op else None
        if not self.all_gather_via_broadcast:
            self._count("all_gather", output)
            return dist.all_gather_single(output, shard, group=self.dp.group, async_op=async_op)
        self._count("broadcast", output)
        n = shard.numel()
        mine = output[self.dp.rank * n : (self.dp.rank + 1) * n]
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
        works = _Works(
            [
                dist.broadcast(
                    output[r * n : (r + 1) * n], src=r, group=self.dp.group, async_op=True
                )
                for r in range(self.dp.world_size)
            ]
        )
        if async_op:
            return works
        works.wait()
        return None

    def reduce_scatter_sum(
        self, full: torch.Tensor, shard_out: torch.Tensor, async_op: bool = False
    ):
        """shard_out <- this rank's slice of the sum of `full` over ranks.

        When reduce-scatter is emulated with an all-reduce, `full` is overwritten and the
        caller reads its own slice of it (`shard_out` is then that slice).
        """
        if not self.dp.distributed:
            self._count("reduce_scatter", full)
            if shard_out.data_ptr() != full.data_ptr():
                shard_out.copy_(full)
            return _DoneWork() if async_op else None
        if self.reduce_scatter_via_all_reduce:
            self._count("all_reduce", full)
            return dist.all_reduce(full, group=self.dp.group, async_op=async_op)
        self._count("reduce_scatter", full)
        return dist.reduce_scatter_single(shard_out, full, group=self.dp.group, async_op=async_op)

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = False):
        self._count("all_reduce", tensor)
        if not self.dp.distributed:
            return _DoneWork() if async_op else None
        return dist.all_reduce(tensor, group=self.dp.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, kind: str = "broadcast") -> None:
        self._count(kind, tensor)
        if self.dp.distributed:
            dist.broadcast(tensor, src=src, group=self.dp.group)

    # ----------------------------------------------------- small control messages
    def control_all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Scalars (norms, overflow flags): counted apart from the payload collectives."""
        self._count("control", tensor)
        if self.dp.distributed:
            dist.all_reduce(tensor, op=op, group=self.dp.group)
        return tensor

    def control_all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's copy of a small tensor, stacked: used for divergence checks."""
        flat = tensor.reshape(-1)
        out = torch.empty(
            self.dp.world_size * flat.numel(), dtype=tensor.dtype, device=tensor.device
        )
        self._count("control", out)
        if self.dp.distributed:
            dist.all_gather_single(out, flat, group=self.dp.group)
        else:
            out.copy_(flat)
        return out.view(self.dp.world_size, *tensor.shape)
