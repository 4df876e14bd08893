"""The model's buffers kept as DDP keeps them: rank 0's overwrite every rank's at
construction, and (with `broadcast_buffers`) before the forward that follows a
synchronised training forward, one collective per dtype. BatchNorm statistics then match
what DDP would give each rank, in training and in evaluation. Before the first forward,
persistent buffers of a meta-built model that a load was to fill are checked
(`check_awaited`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..comm.communicator import Communicator


class BufferSync:
    def __init__(
        self,
        module: nn.Module,
        world: Communicator,
        device: torch.device,
        every_forward: bool,
        check_awaited: Callable[[], None] | None = None,
    ):
        self.module = module
        self.world = world  # every data-parallel rank
        self.device = device
        self.every_forward = every_forward  # config.broadcast_buffers
        self.stale = True  # DDP's require_forward_param_sync, for buffers
        # Raises while a buffer that a load was to fill is unfilled (the builder's check).
        self.check_awaited = check_awaited

    def before_forward(self) -> None:
        if self.check_awaited is not None:
            self.check_awaited()
        if self.every_forward and self.stale:
            self.sync()
            self.stale = False

    def after_forward(self, trained: bool) -> None:
        """A forward that a synchronised backward follows may change buffers (`trained`);
        evaluation and no_sync() forwards leave them as they are."""
        self.stale = trained

    def sync(self) -> None:
        """Rank 0's buffers to every rank (collective)."""
        if not self.world.distributed:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buf in self.module.buffers():
            if buf.device.type == self.device.type and buf.numel():
                by_dtype.setdefault(buf.dtype, []).append(buf)
        for bufs in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in bufs])
            self.world.broadcast(flat, src=0, kind="buffers")
            for buf, value in zip(bufs, flat.split([b.numel() for b in bufs])):
                buf.copy_(value.view_as(buf))
