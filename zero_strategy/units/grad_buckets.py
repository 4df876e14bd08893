"""Stages 2-3, gradients reduced parameter by parameter (gloo): the small ones packed.

On gloo every reduction costs a round of point-to-point messages, and each message costs
about a tenth of a millisecond of CPU in the sender, the receiver and gloo's threads,
whatever its size. Reduced one by one, a model's biases and norms cost more in messages
than in bytes. So each backward, the small gradients of a unit that come one after
another in the reduction order are packed into a bucket, which is reduced as one part
once the last of them is in; a large gradient still goes as autograd made it (copying it
would cost more than the message it saves).

Every rank walks the same agreed order, so every rank packs the same buckets and fills
them at the same turns: their reductions pair up as the single parameters' do. Inside a
bucket the parameters lie in their unit's flat order, so the part of a bucket inside each
rank's shard is one contiguous run of it (`Communicator.reduce_part`), and each element is summed in
the same order as when it was sent alone: the results are bitwise the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..layout.partition import UnitLayout
from .no_gradient import fill_no_gradient
from .reduction_order import MISSING, Entry

# A gradient of at most this many bytes (in the reduction dtype) is packed with others.
SMALL_GRAD_BYTES = 256 * 2**10
# A bucket holds at most this many bytes: it is in memory from its first gradient's turn
# to its landing.
BUCKET_BYTES = 2**20


@dataclass
class GradBucket:
    """Small gradients of one unit reduced together: `slots` in flat-layout order, each at
    `starts[i]` of the packed buffer."""

    unit_index: int
    slots: tuple[int, ...]
    starts: tuple[int, ...]
    numel: int
    segments: tuple[tuple[int, int], ...]  # (offset in the unit's flat layout, numel)
    buffer: torch.Tensor | None = None
    put: set[int] = field(default_factory=set)  # the slots whose gradient is in

    @property
    def complete(self) -> bool:
        return len(self.put) == len(self.slots)

    @property
    def launched(self) -> bool:
        """Complete and handed over to be reduced (`GradBuckets.launch`)."""
        return self.complete and self.buffer is None

    def view_of(self, slot_index: int) -> torch.Tensor:
        """Where slot `slot_index`'s gradient sits in the packed buffer."""
        i = self.slots.index(slot_index)
        end = self.starts[i + 1] if i + 1 < len(self.starts) else self.numel
        return self.buffer[self.starts[i] : end]

    def add(self, slot_index: int, grad: object, dtype: torch.dtype, device: torch.device) -> None:
        """Put one parameter's gradient in (`MISSING`: this rank has none, sent as the
        "no gradient" mark); a second gradient of the same backward adds to the first."""
        if self.buffer is None:
            self.buffer = torch.empty(self.numel, dtype=dtype, device=device)
        view = self.view_of(slot_index)
        if slot_index in self.put:
            if grad is not MISSING:
                view.add_(grad.reshape(-1))
            return
        self.put.add(slot_index)
        if grad is MISSING:
            fill_no_gradient(view)
        else:
            view.copy_(grad.reshape(-1))


def plan_buckets(
    entries: Sequence[Entry],
    layouts: Sequence[UnitLayout],
    element_size: int,
    packs: Callable[[int], bool],
) -> dict[Entry, GradBucket]:
    """This backward's buckets, by entry: the small gradients of a unit that `packs`
    (reduced parameter by parameter) that come one after another in `entries` (the
    reduction order), at most `BUCKET_BYTES` a bucket. A large gradient in between does
    not end a bucket; another unit's entry does. A bucket of one is no bucket."""
    planned: dict[Entry, GradBucket] = {}
    run: list[int] = []
    run_unit, run_bytes = -1, 0

    def close() -> None:
        if len(run) > 1:
            bucket = _bucket(run_unit, sorted(run), layouts[run_unit])
            for slot_index in run:
                planned[(run_unit, slot_index)] = bucket
        run.clear()

    for unit_index, slot_index in entries:
        if unit_index != run_unit:
            close()
            run_unit, run_bytes = unit_index, 0
        if not packs(unit_index):
            continue
        nbytes = layouts[unit_index].slots[slot_index].numel * element_size
        if nbytes > SMALL_GRAD_BYTES:
            continue
        if run_bytes + nbytes > BUCKET_BYTES:
            close()
            run_bytes = 0
        run.append(slot_index)
        run_bytes += nbytes
    close()
    return planned


def _bucket(unit_index: int, slots: list[int], layout: UnitLayout) -> GradBucket:
    starts, segments, at = [], [], 0
    for slot_index in slots:
        slot = layout.slots[slot_index]
        starts.append(at)
        if segments and segments[-1][0] + segments[-1][1] == slot.offset:
            segments[-1] = (segments[-1][0], segments[-1][1] + slot.numel)
        else:
            segments.append((slot.offset, slot.numel))
        at += slot.numel
    return GradBucket(unit_index, tuple(slots), tuple(starts), at, tuple(segments))


class GradBuckets:
    """One backward's buckets, and the bytes of those being filled (counted with the
    gradients in flight: `comm_buffers`)."""

    def __init__(self, on_memory: Callable[[], None]) -> None:
        self.on_memory = on_memory  # told when a bucket's buffer is taken
        self.by_entry: dict[Entry, GradBucket] = {}
        self.filling_bytes = 0

    def plan(
        self,
        entries: Sequence[Entry],
        layouts: Sequence[UnitLayout],
        element_size: int,
        packs: Callable[[int], bool],
    ) -> None:
        """A backward starts: its buckets (`plan_buckets`)."""
        self.by_entry = plan_buckets(entries, layouts, element_size, packs)
        self.filling_bytes = 0

    def forget(self) -> None:
        """The backward is over (or was abandoned half way): no bucket is filling."""
        self.by_entry = {}
        self.filling_bytes = 0

    def pack(
        self, entry: Entry, item: object, dtype: torch.dtype, device: torch.device
    ) -> GradBucket | None:
        """`entry`'s turn: its gradient (or `MISSING`) into its bucket, if it has one still
        filling; that bucket, or None (the entry goes alone)."""
        bucket = self.by_entry.get(entry)
        if bucket is None or bucket.launched:
            return None
        fresh = bucket.buffer is None
        bucket.add(entry[1], item, dtype, device)
        if fresh:
            self.filling_bytes += bucket.buffer.numel() * bucket.buffer.element_size()
            self.on_memory()
        return bucket

    def launch(self, bucket: GradBucket) -> torch.Tensor:
        """A complete bucket's packed gradients, handed over to be reduced."""
        sent, bucket.buffer = bucket.buffer, None
        self.filling_bytes -= sent.numel() * sent.element_size()
        return sent

    def filling(self) -> list[torch.Tensor]:
        """The buffers of the buckets being filled, each once."""
        buffers = {id(b): b.buffer for b in self.by_entry.values() if b.buffer is not None}
        return list(buffers.values())
