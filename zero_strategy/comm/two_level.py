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

Ordering. A second hop can only start once its first is done. Both run on one thread
of the exchange's own, one collective after another, in the order the collectives were
started: every rank starts the same collectives in the same order, so each group sees
the same sequence of hops on every rank, whenever and wherever each rank waits (ranks
whose module paths differ wait at different places, and may block meanwhile on other
groups). The exchange's groups are its own: nothing else interleaves with them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from .communicator import Communicator
from .quantize import dequantize, packed_bytes, quantize


class _Job:
    """One two-hop collective, run on the exchange's thread; wait() re-raises its error."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def wait(self) -> bool:
        self.finished.wait()
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.finished.is_set()


class _Line:
    """A thread that runs jobs one at a time, in the order they were submitted. A daemon:
    a job stuck on a lost peer (until the group's timeout) never holds the process's
    exit."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, run: Callable[[], None]) -> _Job:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._serve, name="zero-two-hop", daemon=True)
            self._thread.start()
        job = _Job(run)
        self._jobs.put(job)
        return job

    def stop(self) -> None:
        """Let the thread end once the jobs before it are done (a later job starts it
        again)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    def _serve(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                with torch.no_grad():
                    job.run()
            except BaseException as error:  # raised again by the waiting rank's wait()
                job.error = error
            job.finished.set()


class TwoLevelExchange:
    """One rank's two-hop collectives over the data-parallel world."""

    def __init__(
        self,
        node: Communicator,
        across: Communicator,
        quantize_weights: bool,
        quantize_gradients: bool,
        device: torch.device,
    ) -> None:
        self.node, self.across = node, across  # L ranks of this node; N at place l
        self.quantize_weights = quantize_weights
        self.quantize_gradients = quantize_gradients
        self._line = _Line(device)

    @property
    def keeps_secondary(self) -> bool:
        """Whether a forward's column is worth keeping for backward (L > 1)."""
        return self.node.size > 1

    def close(self) -> None:
        """The engine's groups are closing: the thread ends after the jobs in flight."""
        self._line.stop()

    def _submit(self, run: Callable[[], None]) -> _Job:
        # Groups closed since their last use are re-created here, on the caller's thread,
        # where every other collective re-creates them: never two threads at once.
        self.node.refresh()
        return self._line.submit(run)

    def _shape(self, full: torch.Tensor) -> tuple[int, int, int]:
        nodes, per_node = self.across.size, self.node.size
        return nodes, per_node, full.numel() // (nodes * per_node)

    # ------------------------------------------------------------------ gather
    def start_gather(
        self,
        target: torch.Tensor,
        shard: torch.Tensor,
        column: torch.Tensor | None = None,
        quantize_ok: bool = True,
    ) -> tuple[_Job, torch.Tensor]:
        """Start gathering every rank's `shard` into `target` (the whole vector); from a
        kept `column` the across-node hop is skipped. Returns the work and the column.
        `quantize_ok=False`: whole values even with quantized weights (parameters kept
        in fp32 for their precision)."""
        nodes, per_node, chunk = self._shape(target)
        if column is not None:
            return self._submit(lambda: self._spread(column, target)), column
        if per_node == 1:  # the column is the whole vector
            column = target
        else:
            column = torch.empty(nodes * chunk, dtype=target.dtype, device=target.device)

        def run() -> None:
            if self.quantize_weights and quantize_ok:
                packed = quantize(shard.view(1, chunk))
                arrived = packed.new_empty(nodes * packed.shape[1])
                self.across.all_gather(arrived, packed.view(-1))
                rows = arrived.view(nodes, packed_bytes(chunk))
                column.view(nodes, chunk).copy_(dequantize(rows, chunk, column.dtype))
            else:
                self.across.all_gather(column, shard)
            if per_node > 1:
                self._spread(column, target)

        return self._submit(run), column

    def _spread(self, column: torch.Tensor, target: torch.Tensor) -> None:
        """Within the node: every rank's column, laid out as the whole vector."""
        nodes, per_node, chunk = self._shape(target)
        stacked = torch.empty(per_node * nodes * chunk, dtype=column.dtype, device=column.device)
        self.node.all_gather(stacked, column)
        target.view(nodes, per_node, chunk).copy_(
            stacked.view(per_node, nodes, chunk).transpose(0, 1)
        )

    # ------------------------------------------------------------------ reduce
    def start_reduce_scatter(
        self, full: torch.Tensor, out: torch.Tensor, quantize_ok: bool = True
    ) -> _Job:
        """Start summing `full` over the world; `out` gets this rank's chunk of the sum
        once the returned work's wait() returns. `full` is overwritten. `quantize_ok`:
        as for gathers."""
        nodes, per_node, chunk = self._shape(full)

        def run() -> None:
            column = full
            if per_node > 1:
                reordered = full.view(nodes, per_node, chunk).transpose(0, 1).contiguous()
                column = reordered.view(per_node, nodes * chunk)[self.node.rank]
                if not self.node.reduces_in_place:
                    column = torch.empty_like(column)
                self.node.reduce_scatter_sum(reordered.view(-1), column)
            self._reduce_across(column, out, quantize_ok)

        return self._submit(run)

    def _reduce_across(self, column: torch.Tensor, out: torch.Tensor, quantize_ok: bool) -> None:
        """The across-node hop of a reduction: this rank's chunk of the sum into `out`."""
        nodes, chunk, me = self.across.size, out.numel(), self.across.rank
        if self.quantize_gradients and quantize_ok:
            rows = column.view(nodes, chunk)
            arrived = self.across.all_to_all(quantize(rows), [1] * nodes, [1] * nodes)
            parts = dequantize(arrived, chunk, torch.float32)
            parts[me] = rows[me]  # this rank's own part, exactly
            out.copy_(parts.sum(dim=0))
        elif self.across.reduces_in_place:
            mine = column[me * chunk : (me + 1) * chunk]
            self.across.reduce_scatter_sum(column, mine)
            out.copy_(mine)
        else:
            self.across.reduce_scatter_sum(column, out)
