"""The host buffers the per-unit disk tiers read and write through, shared between them.

Stage 3 can keep both the parameter shards (offload_params="disk") and the gradient
shards (offload_optimizer="disk") in files, each unit's region read into or written from
a host buffer the size of the largest one. With a set of buffers per tier the process
would hold twice `buffer_count` of them for good: on the 2B moonshot, 4 more buffers of
157 MB per rank than the tiers ever use at once. The tiers share one set instead.

A buffer is free, holds a read ahead (until its unit is used), or holds the values of a
write (until it is needed for something else: a use of that unit meanwhile copies from
it rather than reading the file). A tier that needs one takes a free buffer, or makes one
while fewer than `count` exist, or else takes back the oldest write's buffer (its own
first, then the other tier's); only when every buffer holds a read ahead or is in use is
one more made. Reads ahead are bounded over both tiers, so that writes always find room.
Every call comes from the training thread; the tiers' threads only read and write files.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .offload_file import aligned_empty

Reclaim = Callable[[], "torch.Tensor | None"]  # a tier's oldest write's buffer, or None


class StagingBuffers:
    def __init__(self, count: int, on_memory: Callable[[], None] = lambda: None):
        self.count = max(2, count)
        self.on_memory = on_memory  # told after a buffer is made
        self.nbytes = 0  # of each buffer: the largest region of any tier
        self.free: list[torch.Tensor] = []
        self.live = 0  # buffers in existence
        self.reading = 0  # buffers holding reads ahead, over every tier
        self._reclaims: list[Reclaim] = []

    def join(self, nbytes: int, reclaim: Reclaim) -> None:
        """A tier whose largest region is `nbytes` takes part (before any buffer exists)."""
        if self.live:
            raise RuntimeError("a tier joined the staging buffers after they were made")
        self.nbytes = max(self.nbytes, nbytes)
        self._reclaims.append(reclaim)

    def take(self, reclaim_first: Reclaim) -> torch.Tensor:
        """A buffer for the tier whose `reclaim` is `reclaim_first` (see the module)."""
        if self.free:
            return self.free.pop()
        if self.live < self.count:
            return self._new()
        for reclaim in (reclaim_first, *(r for r in self._reclaims if r is not reclaim_first)):
            buffer = reclaim()
            if buffer is not None:
                return buffer
        return self._new()

    def give(self, buffer: torch.Tensor) -> None:
        self.free.append(buffer)

    def may_read_ahead(self) -> bool:
        """Whether one more read ahead leaves two buffers for writes and uses."""
        return self.reading < self.count - 2

    def _new(self) -> torch.Tensor:
        self.live += 1
        buffer = aligned_empty(self.nbytes)
        self.on_memory()
        return buffer
