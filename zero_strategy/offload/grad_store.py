"""Stages 2-3 with offload_optimizer="disk": each unit's fp32 gradient shard in a file from
the moment its reduction lands until the step reads it.

A synchronised backward lands each unit's reduced gradient in its shard: the shard is in
memory only while a reduction lands in it (`acquire`, add, `release(modified=True)`), and
is written behind on a thread. After `zero_grad` a shard is known to be zero (`forget`):
its next landing starts from zeros without reading the file, so an accumulation made with
`no_sync()` writes each shard once per step and the step reads it once. An accumulation
that reduces every micro-batch reads each shard back at each landing after the first.

What changes gradients between backward and step without needing their values at once
(taking the loss scale out, clipping's scale, a clamp, zeroing some param groups) is kept
as a pending change of the unit (`change`) and applied, in order, each time the shard is
read: the file and the pending changes together are the gradient. A use that only reads
(the step) writes nothing back; the next write (a landing) includes the changes and
clears them. No extra pass over the file, and no write in the step. The global norm is
taken as the shards land (the engine's `LandedNorms`), so clipping needs no pass over
them either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..units.flat_unit import FlatUnit
from ..units.no_gradient import NO_GRADIENT
from .offload_file import OffloadFile
from .shard_store import DiskShards
from .staging import StagingBuffers


def _gradient(unit: FlatUnit) -> list[torch.Tensor]:
    return [unit.grad_opt]


class DiskGrads:
    """The fp32 gradient shards of `units` in `file`, zero at first."""

    offloaded = True

    def __init__(
        self,
        units: Sequence[FlatUnit],
        file: OffloadFile,
        staging: StagingBuffers,
        on_memory: Callable[[], None] = lambda: None,
    ):
        self.store = DiskShards(
            units,
            file,
            staging,
            on_memory,
            tensors_of=_gradient,
            starts_zero=True,
            zero=NO_GRADIENT,
            what="gradient shards",
            kind="gradients",
        )
        self._pending: dict[int, list[Callable[[], None]]] = {}
        self._modified: set[int] = set()  # in use, and changed by a user: written after

    # ------------------------------------------------------------------ uses
    def acquire(self, unit: FlatUnit) -> None:
        """The unit's gradient shard in memory, its pending changes applied (until the
        matching `release`)."""
        first = not self.store.uses(unit)
        self.store.acquire(unit)
        if not first:
            return
        try:
            for change in self._pending.get(unit.layout.index, ()):
                change()
        except BaseException:
            self.store.release(unit)
            raise

    def release(self, unit: FlatUnit, modified: bool = False) -> None:
        """One use is over; after the last, the shard is written if a use `modified` it
        (with its pending changes, which that clears), else let go as it is in the file."""
        index = unit.layout.index
        if modified:
            self._modified.add(index)
        if self.store.uses(unit) == 1 and index in self._modified:
            self._modified.discard(index)
            self._pending.pop(index, None)  # the values written include them
        self.store.release(unit, modified)

    def prefetch(self, unit: FlatUnit) -> None:
        self.store.prefetch(unit)

    def change(self, unit: FlatUnit, change: Callable[[], None]) -> None:
        """Apply `change` (in place, to views of the unit's gradient shard) now if the
        shard is in memory, else when it next is. A change must keep zeros zero (a
        scale, a clamp, a zeroing): a shard known to be zero skips it."""
        index = unit.layout.index
        if self.store.uses(unit):
            change()  # and kept, for the next read if this use writes nothing back
        elif self.store.is_zero(unit):
            return
        self._pending.setdefault(index, []).append(change)

    def forget(self, unit: FlatUnit) -> None:
        """zero_grad: the shard is zero, whatever the file holds."""
        self._pending.pop(unit.layout.index, None)
        self.store.forget(unit)

    def resident_bytes(self) -> int:
        """The gradient shards in memory now (while their reductions land, or they step):
        every byte of `gradients` in memory, with the shards offloaded."""
        return self.store.resident_bytes

    # ------------------------------------------------------------------ the tier
    @property
    def failure(self) -> BaseException | None:
        return self.store.failure

    def settle(self, wait: bool) -> None:
        self.store.settle(wait)

    def refuse(self) -> None:
        self.store.refuse()

    def recover(self) -> None:
        self.store.recover()

    def buffers(self) -> list[torch.Tensor]:
        return self.store.buffers()

    def disk_bytes(self) -> dict[str, int]:
        return self.store.disk_bytes()

    def closer(self) -> Callable[[], None]:
        return self.store.closer()
