"""Process groups: the data-parallel group the engine communicates over.

The engine never uses the caller's default group for its own collectives: it creates a
group of its own, with the configured timeout, so that a peer that never joins raises
instead of hanging, and so that user collectives cannot interleave with ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def backend_for(device: torch.device) -> str:
    """nccl for CUDA tensors, gloo for everything else."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class DataParallelGroup:
    """Who we are in the data-parallel world, and the group to talk over."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    backend: str

    @classmethod
    def create(cls, device: torch.device, timeout_s: float) -> DataParallelGroup:
        if not dist.is_available() or not dist.is_initialized():
            return cls(rank=0, world_size=1, group=None, backend="none")
        backend = backend_for(device)
        # get_backend_config, not get_backend: a plain init_process_group() (torchrun's
        # usual call) reports "undefined" there but "cpu:gloo,cuda:nccl" here.
        default_backend = str(dist.get_backend_config()).lower()
        if backend == "nccl" and "nccl" not in default_backend:
            raise RuntimeError(
                "Parameters are on CUDA but the default process group uses "
                f"'{default_backend}'. Initialize it with backend='nccl' (or 'cpu:gloo,cuda:nccl')."
            )
        group = dist.new_group(
            ranks=list(range(dist.get_world_size())),
            timeout=timedelta(seconds=timeout_s),
            backend=backend,
        )
        return cls(
            rank=dist.get_rank(), world_size=dist.get_world_size(), group=group, backend=backend
        )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1
