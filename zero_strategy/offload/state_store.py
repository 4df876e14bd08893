"""Where the optimizer's elementwise state lives: in memory, or in a file streamed by tiles.

The user's optimizer keeps its `state` mapping and its own step: the engine hands it, one
tile at a time, the state of that tile's parameters (`apply`), and the optimizer updates
it as usual. In memory (`ResidentState`) the tile is everything and nothing moves. On disk
(`DiskState`) each tile's state is read into a host buffer just before its step and
written back just after, on background threads: the read of the next tiles and the write
of the previous one overlap the current one's step, within `buffer_count` buffers. The
step does not wait for its last writes: they finish during the next forward, and the next
step (or a save) waits for them before reading the file. A failed write is kept, not
raised where it is found: the engine asks every rank's tiers at the start of the next step
(`failure`) and all ranks raise together, so that no rank is left waiting in a collective.
Between steps `optimizer.state` holds meta tensors of the right shape and dtype in their
place (scalars such as Adam's `step` stay in memory): nothing reads freed memory by
mistake, and anything that needs the values (a checkpoint) asks the store.

A tensor is elementwise state when it is 1-D with one value per element of its
parameter (exp_avg, exp_avg_sq, momentum_buffer, the sharded EMA...); that is what the
sharded checkpoints store and reshard, and what moves to disk here.
"""

from __future__ import annotations

import errno
import functools
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Union

import torch

from ..units.optimizer_view import OptimizerView
from .failures import KeptFailure
from .host_memory import return_freed_memory
from .offload_file import ALIGN, OffloadError, OffloadFile, aligned_empty, round_up

TileStep = Callable[[list[OptimizerView]], None]  # steps the views of one tile
OptimizerStateStore = Union["ResidentState", "DiskState"]


def elementwise_keys(entry: dict[str, Any], numel: int) -> list[str]:
    return [
        k
        for k, v in entry.items()
        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == numel
    ]


class ResidentState:
    """The optimizer state where the optimizer put it (no offload)."""

    offloaded = False

    failure: BaseException | None = None  # nothing is written anywhere

    def __init__(self, state: MutableMapping[Any, Any]):
        self.state = state

    def apply(self, views: Sequence[OptimizerView], step: TileStep) -> None:
        step(list(views))

    def settle(self, wait: bool) -> None:
        pass

    def refuse(self) -> None:
        pass

    def dtypes(self, view: OptimizerView) -> dict[str, torch.dtype]:
        """The view's elementwise state: key -> dtype."""
        return _dtypes_in_memory(self.state, view)

    def read(self, view: OptimizerView, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of `key`'s state of `view` (a view of it, not a copy)."""
        return self.state[view.param][key][lo:hi]

    def put(self, view: OptimizerView, entry: dict[str, Any]) -> None:
        self.state[view.param] = entry

    def clear(self) -> None:
        self.state.clear()

    def disk_bytes(self) -> int:
        return 0

    def buffers(self) -> list[torch.Tensor]:
        return []

    def closer(self) -> Callable[[], None]:
        return _nothing


@dataclass(frozen=True)
class _Slot:
    """One state tensor of a view, at byte `at` of the view's region."""

    key: str
    dtype: torch.dtype
    at: int


@dataclass(frozen=True)
class _Region:
    """A view's state on disk: `nbytes` (aligned) at `offset` of the file."""

    offset: int
    nbytes: int
    slots: tuple[_Slot, ...]


class DiskState(KeptFailure):
    """The optimizer's elementwise state in `file`, stepped tile by tile."""

    offloaded = True

    def __init__(
        self,
        state: MutableMapping[Any, Any],
        views: Sequence[OptimizerView],
        file: OffloadFile,
        tile_elements: int,
        buffer_count: int,
        on_memory: Callable[[], None] = lambda: None,
    ):
        self.state = state
        self.on_memory = on_memory  # told after buffers are taken or given back
        self.file = file
        self.buffer_count = max(2, buffer_count)
        self.tiles = _tiles(views, tile_elements)
        self._regions: dict[int, _Region] = {}  # id(view) -> where its state is
        self._placeholders: dict[tuple[int, str], torch.Tensor] = {}
        self._free: list[torch.Tensor] = []  # staging buffers not in use
        self._writing: list[tuple[torch.Tensor, Future]] = []  # buffers being written
        self._live: list[torch.Tensor] = []  # every staging buffer (free, in use or writing)
        self._failed: str | None = None  # an I/O failure that left the file behind
        self.failure: BaseException | None = None  # a failed write not yet reported
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="zero-offload-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="zero-offload-write")

    # ------------------------------------------------------------------ the step
    def apply(self, views: Sequence[OptimizerView], step: TileStep) -> None:
        """Run `step(tile)` over each tile of `views` with its state in
        memory, reading the next tiles and writing the previous ones meanwhile. An I/O
        failure leaves the file behind the optimizer: the store refuses further use until
        a checkpoint is loaded (`clear`)."""
        self._check_usable()
        self.settle(wait=True)  # the last step's last writes (done long ago)
        chosen = {id(v) for v in views}
        tiles = [t for t in ([v for v in tile if id(v) in chosen] for tile in self.tiles) if t]
        ahead = max(1, self.buffer_count - 2)  # one buffer steps, one is written
        reads: dict[int, tuple[torch.Tensor | None, Future | None]] = {}
        stepping: BaseException | None = None  # the optimizer's own error, not the tier's
        try:
            for i, tile in enumerate(tiles):
                for j in range(i, min(len(tiles), i + 1 + ahead)):
                    if j not in reads:
                        reads[j] = self._submit_read(tiles[j])
                buffer, reading = reads.pop(i)
                if reading is not None:
                    reading.result()
                self._attach(tile, buffer)
                try:
                    step(tile)
                except BaseException as e:
                    stepping = e
                    raise
                finally:
                    self._store(tile, buffer)
        except BaseException as e:
            if e is not stepping:
                self._failed = f"{type(e).__name__}: {e}"
            raise
        finally:
            for buffer, reading in reads.values():  # read ahead of a step that failed
                if reading is not None:
                    reading.exception()
                if buffer is not None:
                    self._free.append(buffer)
            # Given back between steps, but for the last writes' buffers until those are
            # done (early in the next forward): backward, where activations peak, then
            # holds none of the tier's memory.
            self._free.clear()
            self._live = [buffer for buffer, _ in self._writing]
            self.on_memory()

    def settle(self, wait: bool) -> None:
        """Between steps: let go of the buffers of the writes that are done (of every
        write, once done, with `wait`). A failure is kept in `failure`."""
        still = []
        for buffer, writing in self._writing:
            if wait or writing.done():
                self._note(writing)
            else:
                still.append((buffer, writing))
        if len(still) < len(self._writing):
            self._writing = still
            self._live = [buffer for buffer, _ in still]
            self.on_memory()

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise OffloadError(
                errno.EIO,
                f"the optimizer state in {self.file.path} is incomplete since a step failed "
                f"to read or write it ({self._failed}). Load a checkpoint "
                "(engine.load_checkpoint) to continue; saving now would write stale state.",
            )

    def _submit_read(self, tile: list[OptimizerView]) -> tuple[torch.Tensor | None, Future | None]:
        need = self._tile_bytes(tile)
        if need == 0:
            return None, None
        buffer = self._take_buffer(need)
        return buffer, self._reader.submit(self._read_tile, tile, buffer)

    def _read_tile(self, tile: list[OptimizerView], buffer: torch.Tensor) -> None:
        for offset, at, nbytes in self._extents(tile):
            self.file.read(offset, buffer[at : at + nbytes])

    def _placed(self, tile: list[OptimizerView]) -> Iterator[tuple[OptimizerView, _Region, int]]:
        """(view, its region, its offset in the tile's buffer) of each laid-out view: the
        regions packed back to back in tile order, the buffer's layout everywhere."""
        at = 0
        for view in tile:
            region = self._regions.get(id(view))
            if region is not None:
                yield view, region, at
                at += region.nbytes

    def _tile_bytes(self, tile: list[OptimizerView]) -> int:
        """The buffer size the tile's laid-out state needs."""
        return sum(region.nbytes for _, region, _ in self._placed(tile))

    def _extents(self, tile: list[OptimizerView]) -> list[tuple[int, int, int]]:
        """(file offset, buffer offset, bytes) of the tile's regions, neighbours in the
        file merged into one I/O."""
        extents: list[list[int]] = []
        for _, region, at in self._placed(tile):
            last = extents[-1] if extents else None
            if last is not None and last[0] + last[2] == region.offset:
                last[2] += region.nbytes
            else:
                extents.append([region.offset, at, region.nbytes])
        return [(o, a, n) for o, a, n in extents]

    def _attach(self, tile: list[OptimizerView], buffer: torch.Tensor | None) -> None:
        """Point each laid-out view's state entries at its part of `buffer`."""
        for view, region, at in self._placed(tile):
            entry = self.state[view.param]
            for slot in region.slots:
                entry[slot.key] = _typed(buffer, at + slot.at, slot.dtype, view.hi - view.lo)

    def _store(self, tile: list[OptimizerView], buffer: torch.Tensor | None) -> None:
        """Write the tile's state back (laying out views whose keys are new: the first
        step, the EMA's first update) and leave placeholders in the optimizer's state."""
        relayout = [
            v for v in tile if (v.hi - v.lo) and self._keys_changed(v, self.state.get(v.param))
        ]
        for view in relayout:
            old = self._regions.get(id(view))
            if old is not None:  # read already; its space goes to the next layouts
                self.file.release(old.offset, old.nbytes)
            self._regions[id(view)] = self._layout(view, self.state[view.param])
        need = self._tile_bytes(tile)
        if need == 0:
            return
        if relayout or buffer is None:  # pack the tile afresh into a buffer of its new size
            fresh = self._take_buffer(need)
            self._pack(tile, fresh)
            if buffer is not None:
                self._free.append(buffer)
            buffer = fresh
        else:  # a tensor the optimizer replaced rather than updated in place
            self._pack(tile, buffer)
        self._detach(tile)
        # The write holds the file and the buffer, not the store: a write still going when
        # the engine is dropped does not keep it alive.
        writing = self._writer.submit(_write_extents, self.file, self._extents(tile), buffer)
        self._writing.append((buffer, writing))
        if relayout:  # the state the optimizer just created in memory is freed
            return_freed_memory()

    def _keys_changed(self, view: OptimizerView, entry: dict[str, Any] | None) -> bool:
        keys = elementwise_keys(entry or {}, view.hi - view.lo)
        region = self._regions.get(id(view))
        known = [s.key for s in region.slots] if region is not None else []
        return sorted(keys) != sorted(known) or any(
            entry[k].dtype != s.dtype for s, k in zip(region.slots if region else (), known)
        )

    def _layout(self, view: OptimizerView, entry: dict[str, Any]) -> _Region:
        slots, at = [], 0
        for key in elementwise_keys(entry, view.hi - view.lo):
            value = entry[key]
            slots.append(_Slot(key, value.dtype, at))
            at += round_up(value.numel() * value.element_size())
        return _Region(self.file.allocate(at), at, tuple(slots))

    def _pack(self, tile: list[OptimizerView], buffer: torch.Tensor) -> None:
        """Copy the tile's current state tensors into `buffer` at their regions' places."""
        for view, region, at in self._placed(tile):
            entry = self.state[view.param]
            for slot in region.slots:
                target = _typed(buffer, at + slot.at, slot.dtype, view.hi - view.lo)
                if entry[slot.key].data_ptr() != target.data_ptr():  # not already there
                    target.copy_(entry[slot.key])

    def _detach(self, tile: list[OptimizerView]) -> None:
        for view, region, _ in self._placed(tile):
            entry = self.state[view.param]
            for slot in region.slots:
                entry[slot.key] = self._placeholder(view, slot)

    def _placeholder(self, view: OptimizerView, slot: _Slot) -> torch.Tensor:
        key = (id(view), slot.key)
        held = self._placeholders.get(key)
        if held is None or held.dtype != slot.dtype:
            held = torch.empty(view.hi - view.lo, dtype=slot.dtype, device="meta")
            self._placeholders[key] = held
        return held

    # ------------------------------------------------------------------ buffers
    def _take_buffer(self, nbytes: int) -> torch.Tensor:
        """A staging buffer of at least `nbytes`: a free one, a new one while fewer than
        `buffer_count` exist, else the oldest being written once its write is done."""
        while True:
            for i, buffer in enumerate(self._free):
                if buffer.numel() >= nbytes:
                    return self._free.pop(i)
            if self._free:  # too small: drop it, a bigger one replaces it
                small = self._free.pop()
                self._live = [b for b in self._live if b is not small]
                continue
            if len(self._live) < self.buffer_count or not self._writing:
                self._live.append(aligned_empty(nbytes))
                self.on_memory()
                return self._live[-1]
            buffer, writing = self._writing.pop(0)
            self._free.append(buffer)
            self._note(writing)  # reported at the start of the next step, on every rank

    # ------------------------------------------------------------------ checkpoints
    def dtypes(self, view: OptimizerView) -> dict[str, torch.dtype]:
        """The view's elementwise state: key -> dtype (on disk, or still in memory)."""
        region = self._regions.get(id(view))
        if region is not None:
            return {s.key: s.dtype for s in region.slots}
        return _dtypes_in_memory(self.state, view)

    def read(self, view: OptimizerView, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of `key`'s state of `view`, read from the file (a new tensor)."""
        self.settle(wait=True)
        if self.failure is not None:
            self.refuse()
        self._check_usable()
        region = self._regions.get(id(view))
        if region is None:
            return self.state[view.param][key][lo:hi]
        slot = next(s for s in region.slots if s.key == key)
        size = slot.dtype.itemsize
        data = self.file.read_bytes(region.offset + slot.at + lo * size, (hi - lo) * size)
        return data.view(slot.dtype)

    def put(self, view: OptimizerView, entry: dict[str, Any]) -> None:
        """Take a whole entry (a checkpoint's): its elementwise tensors go to the file."""
        self.state[view.param] = entry
        if not (view.hi - view.lo) or not elementwise_keys(entry, view.hi - view.lo):
            return
        region = self._layout(view, entry)
        self._regions[id(view)] = region
        buffer = aligned_empty(region.nbytes)  # this view's alone, dropped on return
        self._pack([view], buffer)
        self.file.write(region.offset, buffer[: region.nbytes])
        self._detach([view])
        del buffer
        return_freed_memory()

    def clear(self) -> None:
        """Forget every state (a checkpoint load follows, putting each view's)."""
        self.settle(wait=True)  # a failed write: its bytes are moot now
        self.state.clear()
        self._regions.clear()
        self._placeholders.clear()
        self.file.reset()
        self._failed = self.failure = None

    # ------------------------------------------------------------------ accounting
    def disk_bytes(self) -> int:
        """Bytes of state in the file now (space left by re-laid-out views excluded)."""
        return sum(r.nbytes for r in self._regions.values())

    def buffers(self) -> list[torch.Tensor]:
        """The staging buffers held now (host memory; between steps, those of the last
        writes until they are done)."""
        return list(self._live)

    def closer(self) -> Callable[[], None]:
        """Closes the file and stops the threads. It holds nothing but them, so that a
        finalizer can keep it without keeping the optimizer (and the engine) alive; it
        waits for the writes in flight."""
        return functools.partial(_close, self._reader, self._writer, self.file)


def _close(reader: ThreadPoolExecutor, writer: ThreadPoolExecutor, file: OffloadFile) -> None:
    reader.shutdown(wait=True)
    writer.shutdown(wait=True)
    file.close()


def _write_extents(
    file: OffloadFile, extents: list[tuple[int, int, int]], buffer: torch.Tensor
) -> None:
    for offset, at, nbytes in extents:
        file.write(offset, buffer[at : at + nbytes])


def _nothing() -> None:
    pass


def _dtypes_in_memory(state: MutableMapping[Any, Any], view: OptimizerView) -> dict:
    entry = state.get(view.param, {})
    return {k: entry[k].dtype for k in elementwise_keys(entry, view.hi - view.lo)}


def _typed(buffer: torch.Tensor, at: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    size = dtype.itemsize
    assert at % ALIGN == 0
    return buffer[at : at + numel * size].view(dtype)


def _tiles(views: Sequence[OptimizerView], tile_elements: int) -> list[list[OptimizerView]]:
    """Consecutive views, about `tile_elements` parameter elements per tile (a view larger
    than that is a tile of its own: a view is the optimizer's unit of work)."""
    tiles: list[list[OptimizerView]] = []
    size = 0
    for view in views:
        numel = view.hi - view.lo
        if not tiles or size + numel > tile_elements:
            tiles.append([])
            size = 0
        tiles[-1].append(view)
        size += numel
    return tiles
