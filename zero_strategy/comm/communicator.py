"""Collectives over one process group, with byte accounting for `comm_report()`.

Every engine collective goes through a `Communicator` (one per group) so that the report
is exact; the engine's report sums them. Bytes
are counted as the size of the full (unsharded) tensor a collective is about: the input
of a reduce-scatter or all-reduce, the output of an all-gather. Each is recorded under
the collective it stands for. On gloo, whose own reduce-scatter and all-gather are slow,
a reduce-scatter is done with point-to-point sends (each rank sends every other rank that
rank's slice and adds up what it receives: half the bytes of an all-reduce) and an
all-gather is one broadcast per rank (counted under "broadcast"); a reduce-scatter can
also be asked to run as an in-place all-reduce (counted under "all_reduce").
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .nodes import nodes_of, ranks_per_node

if TYPE_CHECKING:
    from .topology import CommGroup


# What gloo and NCCL say when a peer died (its sockets closed) or stopped answering (the
# group's timeout ran out): the two ways a job loses a rank mid-collective.
_PEER_LOST_SIGNS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "watchdog",
    "nccl communicator was aborted",
)


class PeerLostError(dist.DistBackendError):
    """A collective failed because another rank died or stopped answering. The job cannot
    continue from here: every rank's state is mid-step. Restart it from the last
    checkpoint (torchrun's `--max-restarts` does that automatically). A DistBackendError,
    as torch's own error for it, so `except torch.distributed.DistError` still catches it.

    This is what gloo reports. With NCCL's default asynchronous error handling the
    watchdog aborts the process instead, and the launcher sees the failure."""


def _packed_range(segments: Sequence[tuple[int, int]], lo: int, hi: int) -> tuple[int, int]:
    """[start, end) of the elements with flat offsets in [lo, hi) in a part that packs
    `segments` ((offset, numel), rising) one after another: one run, as they rise."""
    return _packed_position(segments, lo), _packed_position(segments, hi)


def _packed_position(segments: Sequence[tuple[int, int]], flat: int) -> int:
    """How many packed elements have a flat offset below `flat`."""
    at = 0
    for offset, numel in segments:
        if flat <= offset:
            return at
        if flat < offset + numel:
            return at + flat - offset
        at += numel
    return at


def peer_lost(kind: str, group: CommGroup, error: BaseException) -> BaseException:
    """`error` as a `PeerLostError` naming the collective and the group when it is a lost
    peer; any other error (a shape mismatch, a programming error) unchanged."""
    text = str(error)
    if isinstance(error, PeerLostError) or not any(s in text.lower() for s in _PEER_LOST_SIGNS):
        return error
    others = [r for i, r in enumerate(group.ranks) if i != group.rank]
    # gloo's text: "[<source file>:<line>] Read error ...: Connection reset by peer. This is
    # typically caused by ...": keep the cause, drop the source location and the advice.
    cause = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0]).split(". ")[0]
    return PeerLostError(
        f"A peer stopped answering during {kind} on the engine's group of ranks "
        f"{list(group.ranks)} (this is rank {group.ranks[group.rank]}; the peers are "
        f"{others}): {cause[:300]}. Another rank died, was killed or hangs; its log "
        "says why. Restart the job from the last checkpoint (torchrun --max-restarts does "
        "this), and raise ZeroConfig.collective_timeout if a rank was only slow."
    )


class _GuardedWork:
    """An asynchronous collective whose wait() names a lost peer."""

    def __init__(self, work: dist.Work, kind: str, group: CommGroup) -> None:
        self.work, self.kind, self.group = work, kind, group

    def wait(self) -> bool:
        if self.work is None:
            return True
        try:
            self.work.wait()
        except Exception as e:
            raise peer_lost(self.kind, self.group, e) from e
        finally:
            self.work = None  # a finished work object holds its tensors and group
        return True

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


class _DoneWork:
    """Stands in for a finished collective on a single process."""

    def is_completed(self) -> bool:
        return True

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

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class _PairwiseSum:
    """A reduce-scatter made of point-to-point sends: once they are all done, this rank's
    part holds its own values plus every other rank's, added to it in rank order. Each
    element is summed on its owner only; beyond 2 ranks that order differs from an
    all-reduce's, so the two agree to rounding, not bit for bit."""

    def __init__(self, sends: list, receives: list, mine: torch.Tensor | None) -> None:
        self.sends, self.receives, self.mine = sends, receives, mine

    @property
    def receive_buffers(self) -> list[torch.Tensor]:
        """The buffers the other ranks' parts land in, until they are added."""
        return [buf for _, buf in self.receives]

    def wait(self) -> bool:
        for work in self.sends:
            work.wait()
        for work, buf in self.receives:
            work.wait()
            self.mine.add_(buf)
        self.sends, self.receives = [], []
        return True


# How a reduce-scatter is carried out: the backend's own collective, an in-place
# all-reduce, or point-to-point sends (gloo's fastest).
REDUCE_SCATTER_WAYS = ("native", "all_reduce", "pairwise")


class Communicator:
    def __init__(
        self,
        group: CommGroup,
        reduce_scatter: str,
        all_gather_via_broadcast: bool,
        refresh: Callable[[], None],
    ):
        if reduce_scatter not in REDUCE_SCATTER_WAYS:
            raise ValueError(f"reduce_scatter must be one of {REDUCE_SCATTER_WAYS}")
        self.group = group
        # Re-creates the engine's groups after a close(), or on a new default group.
        self.refresh = refresh
        self.reduce_scatter = reduce_scatter
        self.all_gather_via_broadcast = all_gather_via_broadcast
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        # Bytes this rank receives from ranks of other nodes, and of its own, in the
        # direct-exchange form of each collective (what the gloo paths above do: a
        # rank's slice to every other rank).
        self.across: dict[str, int] = defaultdict(int)
        self.within: dict[str, int] = defaultdict(int)
        self._nodes = nodes_of(group.ranks, ranks_per_node())
        self._node = self._nodes[group.rank]
        self._elsewhere = sum(node != self._node for node in self._nodes)

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def distributed(self) -> bool:
        return self.group.distributed

    @property
    def reduces_in_place(self) -> bool:
        """Whether a reduce-scatter leaves this rank's slice of the sum in the input's own
        memory (so a part of the input, such as one parameter's gradient, can be reduced
        on its own: `reduce_part`)."""
        return self.reduce_scatter != "native" or not self.distributed

    def _count(
        self,
        kind: str,
        tensor: torch.Tensor,
        copies: int = 1,
        src: int | None = None,
        rows_from: list[int] | None = None,
    ) -> None:
        """One call of `kind` about `tensor` (its full size). What this rank receives:
        from a broadcast, all of it from `src`; otherwise 1/size of it from each other
        rank, `copies` times (an all-reduce is a reduce-scatter and an all-gather: 2)."""
        # Closed at a teardown and used again (a save after fit, an evaluation), or the
        # default group was re-created: every rank reaches the same first collective, so
        # all re-create the groups together.
        self.refresh()
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes[kind] += nbytes
        self.calls[kind] += 1
        if rows_from is not None:  # an all-to-all: rows_from[r] rows from rank r
            row = nbytes // max(tensor.shape[0], 1) if tensor.dim() else nbytes
            for r, rows in enumerate(rows_from):
                if r != self.group.rank:
                    elsewhere = self._nodes[r] != self._node
                    (self.across if elsewhere else self.within)[kind] += rows * row
            return
        if src is not None:
            if src != self.group.rank:
                elsewhere = self._nodes[src] != self._node
                (self.across if elsewhere else self.within)[kind] += nbytes
            return
        share = copies * nbytes // self.group.size
        self.across[kind] += share * self._elsewhere
        self.within[kind] += share * (self.group.size - 1 - self._elsewhere)

    def _issue(
        self, kind: str, call: Callable[[], dist.Work | None], async_op: bool = False
    ) -> _GuardedWork | None:
        """Run one torch.distributed call; a lost peer becomes a `PeerLostError`, here or
        at the returned work's wait()."""
        try:
            work = call()
        except Exception as e:
            raise peer_lost(kind, self.group, e) from e
        return _GuardedWork(work, kind, self.group) if async_op else None

    def report(self) -> dict[str, dict[str, int]]:
        return {
            k: {
                "bytes": self.bytes[k],
                "calls": self.calls[k],
                "within_node_bytes": self.within[k],
                "across_node_bytes": self.across[k],
            }
            for k in sorted(self.bytes)
        }

    def reset(self) -> None:
        for counts in (self.bytes, self.calls, self.within, self.across):
            counts.clear()

    # ------------------------------------------------------------------ collectives
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
        """output (world * shard.numel()) <- every rank's shard, in rank order.

        With `all_gather_via_broadcast`, each rank broadcasts its slice of `output` in
        place: on gloo that moves the same bytes about 3x faster than its all-gather."""
        if not self.group.distributed:
            self._count("all_gather", output)
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return _DoneWork() if async_op else None
        if not self.all_gather_via_broadcast:
            self._count("all_gather", output)
            return self._issue(
                "all_gather",
                lambda: dist.all_gather_single(
                    output, shard, group=self.group.group, async_op=async_op
                ),
                async_op,
            )
        self._count("broadcast", output)
        n = shard.numel()
        mine = output[self.group.rank * n : (self.group.rank + 1) * n]
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
        works = _Works(
            [
                self._issue(
                    "all_gather (one broadcast per rank)",
                    lambda r=r: dist.broadcast(
                        output[r * n : (r + 1) * n],
                        group=self.group.group,
                        group_src=r,
                        async_op=True,
                    ),
                    async_op=True,
                )
                for r in range(self.group.size)
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

        When the reduction is done in place (`reduces_in_place`), `full` is overwritten and
        the caller reads its own slice of it (`shard_out` is then that slice).
        """
        if not self.group.distributed:
            self._count("reduce_scatter", full)
            if shard_out.data_ptr() != full.data_ptr():
                shard_out.copy_(full)
            return _DoneWork() if async_op else None
        if self.reduces_in_place:
            return self.reduce_part(full, full.numel() // self.group.size, async_op)
        self._count("reduce_scatter", full)
        return self._issue(
            "reduce_scatter",
            lambda: dist.reduce_scatter_single(
                shard_out, full, group=self.group.group, async_op=async_op
            ),
            async_op,
        )

    def reduce_part(
        self,
        part: torch.Tensor,
        shard_numel: int,
        async_op: bool = False,
        segments: Sequence[tuple[int, int]] | None = None,
    ):
        """Reduce-scatter one part of a flat vector split into `shard_numel`-element
        slices, one per rank in rank order: `part` holds the runs of its elements that
        `segments` names ((offset, numel) pairs, rising), packed one after another; None:
        the elements [0, part.numel()). In place: afterwards the elements of `part` inside this rank's
        slice hold their sum over the group; the rest are undefined. Every rank reduces
        the same parts in the same order (gradients as backward produces them)."""
        if not self.reduces_in_place:
            raise RuntimeError("reduce_part needs an in-place reduce-scatter (gloo's)")
        if not self.group.distributed:
            self._count("reduce_scatter", part)
            return _DoneWork() if async_op else None
        if self.reduce_scatter == "all_reduce":
            self._count("all_reduce", part, copies=2)
            return self._issue(
                "reduce_scatter (as all_reduce)",
                lambda: dist.all_reduce(part, group=self.group.group, async_op=async_op),
                async_op,
            )
        self._count("reduce_scatter", part)
        if segments is None:
            segments = ((0, part.numel()),)
        me = self.group.rank
        sends, mine = [], None
        for r in range(self.group.size):
            lo, hi = _packed_range(segments, r * shard_numel, (r + 1) * shard_numel)
            if lo >= hi:
                continue
            piece = part[lo:hi]
            if r == me:
                mine = piece
                continue
            sends.append(
                self._issue(
                    "reduce_scatter (pairwise sends)",
                    lambda piece=piece, r=r: dist.isend(piece, group=self.group.group, group_dst=r),
                    async_op=True,
                )
            )
        receives = []
        if mine is not None:
            for r in range(self.group.size):
                if r != me:
                    buf = torch.empty_like(mine)
                    work = self._issue(
                        "reduce_scatter (pairwise sends)",
                        lambda buf=buf, r=r: dist.irecv(buf, group=self.group.group, group_src=r),
                        async_op=True,
                    )
                    receives.append((work, buf))
        work = _PairwiseSum(sends, receives, mine)
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = False):
        self._count("all_reduce", tensor, copies=2)
        if not self.group.distributed:
            return _DoneWork() if async_op else None
        return self._issue(
            "all_reduce",
            lambda: dist.all_reduce(tensor, group=self.group.group, async_op=async_op),
            async_op,
        )

    def all_to_all(
        self, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int]
    ) -> torch.Tensor:
        """Rows of `tensor` to every rank of the group, `input_splits[r]` of them to rank r;
        returns the `output_splits[r]` rows each rank r sent here, in rank order (MoE token
        dispatch: uneven, and empty for a rank that sends or receives nothing)."""
        out = tensor.new_empty(sum(output_splits), *tensor.shape[1:])
        self._count("all_to_all", tensor, rows_from=output_splits)
        if not self.group.distributed:
            return out.copy_(tensor)
        self._issue(
            "all_to_all (expert dispatch)",
            lambda: dist.all_to_all_single(
                out, tensor.contiguous(), output_splits, input_splits, group=self.group.group
            ),
        )
        return out

    def reduce_sum(self, tensor: torch.Tensor, dst: int = 0) -> None:
        """`tensor` on the group's `dst`-th rank <- the sum over the group (the others'
        copies are left undefined): half an all-reduce's traffic where one rank alone
        needs the result."""
        self._count("reduce", tensor)
        if self.group.distributed:
            self._issue(
                "reduce", lambda: dist.reduce(tensor, group=self.group.group, group_dst=dst)
            )

    def broadcast(self, tensor: torch.Tensor, src: int = 0, kind: str = "broadcast") -> None:
        """`tensor` <- its value on the group's `src`-th rank (a position in the group)."""
        self._count(kind, tensor, src=src)
        if self.group.distributed:
            self._issue(kind, lambda: dist.broadcast(tensor, group=self.group.group, group_src=src))

    # ----------------------------------------------------- small control messages
    def control_all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Scalars (norms, overflow flags): counted apart from the payload collectives."""
        self._count("control", tensor, copies=2)
        if self.group.distributed:
            self._issue(
                "all_reduce (control)",
                lambda: dist.all_reduce(tensor, op=op, group=self.group.group),
            )
        return tensor

    def control_all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's copy of a small tensor, stacked: used for divergence checks."""
        out, work = self.control_all_gather_async(tensor)
        work.wait()
        return out

    def control_all_gather_async(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """`control_all_gather` left in flight: the stacked output, filled once the
        returned work's wait() returns."""
        flat = tensor.reshape(-1)
        out = torch.empty(self.group.size * flat.numel(), dtype=tensor.dtype, device=tensor.device)
        self._count("control", out)
        if not self.group.distributed:
            out.copy_(flat)
            return out.view(self.group.size, *tensor.shape), _DoneWork()
        work = self._issue(
            "all_gather (control)",
            lambda: dist.all_gather_single(out, flat, group=self.group.group, async_op=True),
            async_op=True,
        )
        return out.view(self.group.size, *tensor.shape), work

    def control_all_gather_json(self, value: Any, device: torch.device) -> list[Any]:
        """Every rank's JSON-able `value`, exchanged as bytes (no pickle), on `device` (an
        NCCL group refuses CPU tensors)."""
        if not self.group.distributed:
            return [value]
        data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        self.control_all_reduce(size, op=dist.ReduceOp.MAX)
        padded = torch.zeros(int(size), dtype=torch.uint8)
        padded[: data.numel()] = data
        out = self.control_all_gather(padded.to(device)).cpu()
        return [json.loads(bytes(chunk.tolist()).rstrip(b"\0")) for chunk in out]

    def barrier(self) -> None:
        if self.group.distributed:
            self._count("control", torch.empty(0))
            self._issue("barrier", lambda: dist.barrier(group=self.group.group))
