"""Stage 3's gathers and stage 2-3's gradient reductions in two hops, for a slow link
between nodes (ZeRO++'s hpZ and qgZ, FSDP2's `reshard_after_forward=int`).

The data-parallel world of W = N x L ranks is N nodes of L ranks; rank r = n * L + l
holds chunk r of every unit's flat vector (as a flat collective leaves it, so checkpoints
and every other reader see the usual layout).

- Gather: first across nodes, among the N ranks at the same place l of every node:
  each gets its *column*, chunks l, L + l, ..., of the vector; then within the node, the
  L columns, reordered into the whole vector. Across the link a rank receives
  (N - 1) / (N L) of the vector instead of (N - 1) / N. The column is the secondary
  partition: kept from a training forward to the unit's backward, whose gather is then
  within the node only.
- Reduce-scatter: first within the node (each rank gets its node's sum of its column),
  then across nodes over the column (each gets the sum of its own chunk).
- With quantization, the across-node hop carries block-wise int8 (`quantize.py`):
  weights as gathered (every rank computes with the same dequantized values, its own
  chunk included), and gradients as sent (each rank's own part added exactly).

With L = 1 (no hierarchy, quantization only) the node hop is nothing and the column is
the whole vector.

Ordering. A second hop can only start once its first is done, so it is issued later:
at the exchange's next call (a start or a wait of any of its collectives), for every
collective started before, in the order they were started. Every rank starts the same
collectives in the same order, so each group sees the same sequence of hops on every
rank, wherever each rank happens to wait (ranks whose module paths differ wait at
different places). The exchange's groups are its own: nothing else interleaves with
them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from .communicator import Communicator
from .quantize import dequantize, packed_bytes, quantize

_Issue = Callable[[], tuple[object | None, Callable[[], None] | None]]


class _Hops:
    """One two-hop collective: its first hop in flight; its second issued by the
    exchange's pump; its result put in place at wait()."""

    def __init__(
        self,
        exchange: TwoLevelExchange,
        first,
        second: _Issue | None = None,
        finish: Callable[[], None] | None = None,
    ) -> None:
        self.exchange = exchange
        self.first, self.second, self.finish = first, second, finish
        self.then = None  # the second hop's work, once issued
        self.done = False

    def advance(self) -> None:
        """The pump: the first hop done, the second issued."""
        if self.first is not None:
            self.first.wait()
            self.first = None
        if self.second is not None:
            issue, self.second = self.second, None
            self.then, self.finish = issue()

    def wait(self) -> bool:
        if self.done:
            return True
        self.exchange.pump()
        self.advance()
        if self.then is not None:
            self.then.wait()
            self.then = None
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        self.done = True
        return True

    def is_completed(self) -> bool:
        """Only once waited: a poll must not decide when a rank issues its second hop."""
        return self.done


class TwoLevelExchange:
    """One rank's two-hop collectives over the data-parallel world."""

    def __init__(
        self,
        node: Communicator,
        across: Communicator,
        quantize_weights: bool,
        quantize_gradients: bool,
    ) -> None:
        self.node, self.across = node, across  # L ranks of this node; N at place l
        self.quantize_weights = quantize_weights
        self.quantize_gradients = quantize_gradients
        self._waiting: deque[_Hops] = deque()  # second hops not issued yet, oldest first

    @property
    def keeps_secondary(self) -> bool:
        """Whether a forward's column is worth keeping for backward (L > 1)."""
        return self.node.size > 1

    def pump(self) -> None:
        """Issue the second hop of every collective started so far, in order."""
        while self._waiting:
            self._waiting.popleft().advance()

    def _start(self, hops: _Hops) -> _Hops:
        if hops.second is not None:
            self._waiting.append(hops)
        return hops

    def _shape(self, full: torch.Tensor) -> tuple[int, int, int]:
        nodes, per_node = self.across.size, self.node.size
        return nodes, per_node, full.numel() // (nodes * per_node)

    # ------------------------------------------------------------------ gather
    def start_gather(
        self, target: torch.Tensor, shard: torch.Tensor, column: torch.Tensor | None = None
    ) -> tuple[_Hops, torch.Tensor]:
        """Start gathering every rank's `shard` into `target` (the whole vector); from a
        kept `column` the across-node hop is skipped. Returns the work and the column."""
        self.pump()
        nodes, per_node, chunk = self._shape(target)
        if column is not None:
            work, reorder = self._spread(column, target)
            return self._start(_Hops(self, work, finish=reorder)), column
        if per_node == 1:  # the column is the whole vector
            column = target
        else:
            column = torch.empty(nodes * chunk, dtype=target.dtype, device=target.device)
        if not self.quantize_weights:
            first = self.across.all_gather(column, shard, async_op=True)
            unpack = None
        else:
            packed = quantize(shard.view(1, chunk))
            arrived = packed.new_empty(nodes * packed.shape[1])
            first = self.across.all_gather(arrived, packed.view(-1), async_op=True)

            def unpack() -> None:
                rows = arrived.view(nodes, packed_bytes(chunk))
                column.view(nodes, chunk).copy_(dequantize(rows, chunk, column.dtype))

        def second():
            if unpack is not None:
                unpack()
            return self._spread(column, target)

        if per_node == 1:
            return self._start(_Hops(self, first, finish=unpack)), column
        return self._start(_Hops(self, first, second)), column

    def _spread(self, column: torch.Tensor, target: torch.Tensor):
        """Within the node: start gathering every rank's column; returns the work and
        what lays them out as the whole vector once it is done."""
        nodes, per_node, chunk = self._shape(target)
        stacked = torch.empty(per_node * nodes * chunk, dtype=column.dtype, device=column.device)
        work = self.node.all_gather(stacked, column, async_op=True)

        def reorder() -> None:
            target.view(nodes, per_node, chunk).copy_(
                stacked.view(per_node, nodes, chunk).transpose(0, 1)
            )

        return work, reorder

    # ------------------------------------------------------------------ reduce
    def start_reduce_scatter(self, full: torch.Tensor, out: torch.Tensor) -> _Hops:
        """Start summing `full` over the world; `out` gets this rank's chunk of the sum
        once the returned work's wait() returns. `full` is overwritten."""
        self.pump()
        nodes, per_node, chunk = self._shape(full)
        if per_node == 1:
            work, finish = self._reduce_across(full, out)
            return self._start(_Hops(self, work, finish=finish))
        reordered = full.view(nodes, per_node, chunk).transpose(0, 1).contiguous().view(-1)
        place = self.node.rank
        if self.node.reduces_in_place:
            column = reordered[place * nodes * chunk : (place + 1) * nodes * chunk]
        else:
            column = torch.empty(nodes * chunk, dtype=full.dtype, device=full.device)
        first = self.node.reduce_scatter_sum(reordered, column, async_op=True)
        return self._start(_Hops(self, first, lambda: self._reduce_across(column, out)))

    def _reduce_across(self, column: torch.Tensor, out: torch.Tensor):
        """Start the across-node hop of a reduction: (work, what puts the sum in `out`)."""
        nodes, chunk, me = self.across.size, out.numel(), self.across.rank
        if self.quantize_gradients:
            rows = column.view(nodes, chunk)
            arrived = self.across.all_to_all(quantize(rows), [1] * nodes, [1] * nodes)
            parts = dequantize(arrived, chunk, torch.float32)
            parts[me] = rows[me]  # this rank's own part, exactly
            out.copy_(parts.sum(dim=0))
            return None, None
        if not self.across.reduces_in_place:
            return self.across.reduce_scatter_sum(column, out, async_op=True), None
        mine = column[me * chunk : (me + 1) * chunk]
        work = self.across.reduce_scatter_sum(column, mine, async_op=True)
        return work, lambda: out.copy_(mine)
