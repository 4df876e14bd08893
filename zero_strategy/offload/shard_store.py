"""Stage 3: each unit's parameter shard in a file between its uses (offload_params="disk").

A unit's shard (its fp32 master, and its compute-dtype copy when that is a tensor of its
own) is needed at its gathers, at its step and by checkpoints; in between it lives in the
file. Its storages are resized to nothing rather than replaced, so every view of them
(the optimizer's parameters are views of the master) stays the same tensor and sees the
values again once they are read back.

`acquire` and `release` count a unit's uses. The first use reads the shard back (or takes
it from a buffer read ahead, or from the buffer of its last write); the last one writes it
out when it changed (on a writer thread: the write is not waited for until its buffer is
needed, not even at the end of the step) and frees the memory. A failed write is kept in
`failure` for the engine, which asks every rank at the start of the next step.
`prefetch` reads a unit ahead on a reader thread, so that its gather, in the order the
gatherer recorded, finds it in memory. The reads and writes go through host buffers the
size of the largest unit's region, shared with the gradient shards' tier (`staging`).
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..units.flat_unit import FlatUnit
from .failures import KeptFailure
from .host_memory import return_freed_memory
from .offload_file import OffloadError, OffloadFile, aligned_empty, round_up
from .staging import StagingBuffers


@dataclass(frozen=True, eq=False)
class _Region:
    """A unit's shard in the file: its tensors (master, then the compute copy if apart)
    back to back, each at an aligned byte offset."""

    offset: int
    nbytes: int
    tensors: tuple[tuple[torch.Tensor, int], ...]  # (tensor, byte offset in the region)


def shard_tensors(unit: FlatUnit) -> list[torch.Tensor]:
    """The tensors that make up `unit`'s shard: the master (unless it has a tier of its
    own: a gather then reads 2 bytes per element in bf16, not 6), and the compute copy
    when it is not the master itself (bf16/fp16 compute)."""
    tensors = [unit.master] if unit.master_home is None else []
    if unit.shard is not None and unit.shard is not unit.master:
        tensors.append(unit.shard)
    return tensors


def master_alone(unit: FlatUnit) -> list[torch.Tensor]:
    return [unit.master]


class DiskShards(KeptFailure):
    """The shards of `units` (stage 3, not persistent) in `file`."""

    offloaded = True

    def __init__(
        self,
        units: Sequence[FlatUnit],
        file: OffloadFile,
        staging: StagingBuffers,
        on_memory: Callable[[], None] = lambda: None,
        tensors_of: Callable[[FlatUnit], list[torch.Tensor]] = shard_tensors,
        starts_zero: bool = False,
        zero: float = 0.0,
        what: str = "parameter shards",
        kind: str | None = None,
    ):
        self.file = file
        self.what = what  # for errors: what the file holds
        self.kind = kind  # memory_report's kind of every byte (None: parameters, masters)
        self.tensors_of = tensors_of
        # Units whose values are all zero: nothing to read, zero-filled when used (the
        # gradients after zero_grad). Their file bytes are stale and never read.
        self._zero: set[int] = set()
        self.zero = zero  # what those values are (the gradients' 'none yet': -0.0)
        self.on_memory = on_memory  # told after memory is taken or given back
        self.staging = staging  # the host buffers, shared with the other per-unit tier
        self._regions: dict[int, _Region] = {}
        self._uses: dict[int, int] = {}
        self._dirty: set[int] = set()  # in use, and changed by one of its users
        self._reads: dict[int, tuple[torch.Tensor, Future]] = {}  # read ahead
        # The last write of each unit, with the buffer that holds its values: a use that
        # comes before the buffer is taken for something else copies from it.
        self._writes: dict[int, tuple[torch.Tensor, Future]] = {}
        self._retired: list[tuple[torch.Tensor, Future]] = []  # superseded writes
        self.resident_bytes = 0  # of the units' tensors in memory now (in use)
        self._failed: str | None = None
        self.failure: BaseException | None = None  # the first failed write, unreported
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="zero-shards-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="zero-shards-write")
        for unit in units:
            self._lay_out(unit, starts_zero)
        largest = max((r.nbytes for r in self._regions.values()), default=0)
        staging.join(largest, self._reclaim_oldest_write)
        return_freed_memory()

    def _lay_out(self, unit: FlatUnit, starts_zero: bool) -> None:
        tensors, at = [], 0
        for tensor in self.tensors_of(unit):
            storage = tensor.untyped_storage()
            if tensor.storage_offset() or storage.nbytes() != tensor.nbytes:
                raise RuntimeError(  # the engine's own tensors: a bug, not bad input
                    f"unit {unit.layout.name}: its shard does not own its storage"
                )
            tensors.append((tensor, at))
            at += round_up(tensor.nbytes)
        region = _Region(self.file.allocate(at), at, tuple(tensors))
        if starts_zero:
            self._zero.add(unit.layout.index)
        else:
            buffer = aligned_empty(at)
            self._pack(region, buffer)
            self.file.write(region.offset, buffer[:at])
            del buffer
        self._regions[unit.layout.index] = region
        self._uses[unit.layout.index] = 0
        _free_storages(region)

    # ------------------------------------------------------------------ uses
    def acquire(self, unit: FlatUnit) -> None:
        """Make the unit's shard usable (it stays so until the matching `release`)."""
        index = unit.layout.index
        uses = self._uses[index]
        if not uses:
            self._check_usable()
        self._uses[index] = uses + 1
        if uses:
            return
        region = self._regions[index]
        for tensor, _ in region.tensors:
            tensor.untyped_storage().resize_(tensor.nbytes)
        self.resident_bytes += _tensor_bytes(region)
        try:
            if index in self._zero:
                for tensor, _ in region.tensors:
                    tensor.fill_(self.zero)
            elif index in self._writes:  # its latest values are still in that buffer
                self._unpack(region, self._writes[index][0])
            elif index in self._reads:
                buffer, reading = self._reads.pop(index)
                self.staging.reading -= 1
                try:
                    reading.result()
                    self._unpack(region, buffer)
                finally:
                    self.staging.give(buffer)
            else:
                buffer = self.staging.take(self._reclaim_oldest_write)
                try:
                    self.file.read(region.offset, buffer[: region.nbytes])
                    self._unpack(region, buffer)
                finally:
                    self.staging.give(buffer)
        except BaseException:
            self._uses[index] = 0
            _free_storages(region)
            self.resident_bytes -= _tensor_bytes(region)
            raise
        self.on_memory()

    def release(self, unit: FlatUnit, modified: bool = False) -> None:
        """One use of the unit's shard is over; after the last, the shard goes back to
        the file (written only if some use changed it) and its memory is freed."""
        index = unit.layout.index
        if modified:
            self._dirty.add(index)
        self._uses[index] -= 1
        if self._uses[index]:
            return
        region = self._regions[index]
        try:
            if index in self._dirty:
                self._dirty.discard(index)
                self._zero.discard(index)
                buffer = self.staging.take(self._reclaim_oldest_write)
                self._pack(region, buffer)
                if index in self._writes:
                    self._retired.append(self._writes.pop(index))
                writing = self._writer.submit(
                    self.file.write, region.offset, buffer[: region.nbytes]
                )
                self._writes[index] = (buffer, writing)
        finally:
            _free_storages(region)
            self.resident_bytes -= _tensor_bytes(region)
            self.on_memory()

    def prefetch(self, unit: FlatUnit) -> None:
        """Start reading the unit's shard, if it is in the file only and a buffer is
        free for it (reads ahead never hold more than all but two buffers)."""
        index = unit.layout.index
        if (
            index not in self._regions
            or self._uses[index]
            or index in self._reads
            or index in self._writes
            or index in self._zero
            or self.failure is not None
            or not self.staging.may_read_ahead()
        ):
            return
        region = self._regions[index]
        buffer = self.staging.take(self._reclaim_oldest_write)
        self.staging.reading += 1
        reading = self._reader.submit(self.file.read, region.offset, buffer[: region.nbytes])
        self._reads[index] = (buffer, reading)

    def forget(self, unit: FlatUnit) -> None:
        """The unit's values are all zero now (not in use): its next use zero-fills them
        rather than reading the file. A read ahead of older values is waited for (long
        done, as a rule); a write of them still going gives its buffer back once done."""
        index = unit.layout.index
        if self._uses.get(index, 0):
            raise RuntimeError(f"unit {unit.layout.name}: forgotten while in use")
        self._zero.add(index)
        if index in self._reads:  # long done, as a rule: reads ahead are used at once
            buffer, reading = self._reads.pop(index)
            self.staging.reading -= 1
            concurrent.futures.wait([reading])
            self.staging.give(buffer)
        if index in self._writes:
            self._retired.append(self._writes.pop(index))

    def is_zero(self, unit: FlatUnit) -> bool:
        return unit.layout.index in self._zero

    def uses(self, unit: FlatUnit) -> int:
        """How many uses of the unit are going on (0: it is in the file only)."""
        return self._uses.get(unit.layout.index, 0)

    def settle(self, wait: bool) -> None:
        """Note the failures of the writes that are done (of every write, once done, with
        `wait`: the start of the next step, a save) and free the buffers of superseded
        ones. The step does not wait for its own writes: a unit used before its write is
        done is taken from the write's buffer."""
        still = []
        for buffer, writing in self._retired:
            if wait or writing.done():
                self._note(writing)
                self.staging.give(buffer)
            else:
                still.append((buffer, writing))
        self._retired = still
        for _, writing in self._writes.values():
            if wait or writing.done():
                self._note(writing)

    # ------------------------------------------------------------------ buffers
    def _reclaim_oldest_write(self) -> torch.Tensor | None:
        """The buffer of this tier's oldest write (superseded ones first), once it is
        done (its failure kept for the start of the next step, on every rank); None when
        no write holds one."""
        if self._retired:
            buffer, writing = self._retired.pop(0)
        elif self._writes:
            buffer, writing = self._writes.pop(next(iter(self._writes)))
        else:
            return None
        self._note(writing)
        return buffer

    def buffers(self) -> list[torch.Tensor]:
        """The host buffers this tier holds now (pooled memory; the free ones are the
        staging buffers')."""
        return [
            *(b for b, _ in self._reads.values()),
            *(b for b, _ in self._writes.values()),
            *(b for b, _ in self._retired),
        ]

    def _pack(self, region: _Region, buffer: torch.Tensor) -> None:
        for tensor, at in region.tensors:
            buffer[at : at + tensor.nbytes].copy_(tensor.view(-1).view(torch.uint8))

    def _unpack(self, region: _Region, buffer: torch.Tensor) -> None:
        for tensor, at in region.tensors:
            tensor.view(-1).view(torch.uint8).copy_(buffer[at : at + tensor.nbytes])

    # ------------------------------------------------------------------ failures
    def _check_usable(self) -> None:
        if self._failed is not None:
            raise OffloadError(
                errno.EIO,
                f"the {self.what} in {self.file.path} are incomplete since a write "
                f"failed ({self._failed}). Load a checkpoint (engine.load_checkpoint) to "
                "continue: the values in the file are older than the training.",
            )

    def recover(self) -> None:
        """A checkpoint load follows, writing every shard afresh: forget a failure and
        the writes that failed with it."""
        for index, (buffer, writing) in list(self._writes.items()):
            if writing.exception() is not None:
                del self._writes[index]
                self.staging.give(buffer)
        for buffer, _ in self._retired:
            self.staging.give(buffer)
        self._retired.clear()
        self._failed = self.failure = None

    # ------------------------------------------------------------------ accounting
    def disk_bytes(self) -> dict[str, int]:
        """Bytes in the file by kind: all of `kind` when given, else the compute copies as
        `parameters`, the masters as `master_params` (as `parameters` when they are the
        compute copy)."""
        if self.kind is not None:
            return {self.kind: sum(r.nbytes for r in self._regions.values())}
        out = {"parameters": 0, "master_params": 0}
        for region in self._regions.values():
            (_, first), *rest = region.tensors
            if rest:
                out["master_params"] += rest[0][1] - first
                out["parameters"] += region.nbytes - rest[0][1]
            else:
                out["parameters"] += region.nbytes
        return out

    def closer(self) -> Callable[[], None]:
        """Closes the file and stops the threads (it holds nothing else)."""
        return functools.partial(_close, self._reader, self._writer, self.file)


def _tensor_bytes(region: _Region) -> int:
    return sum(tensor.nbytes for tensor, _ in region.tensors)


def _free_storages(region: _Region) -> None:
    for tensor, _ in region.tensors:
        tensor.untyped_storage().resize_(0)


def _close(reader: ThreadPoolExecutor, writer: ThreadPoolExecutor, file: OffloadFile) -> None:
    reader.shutdown(wait=True)
    writer.shutdown(wait=True)
    file.close()
