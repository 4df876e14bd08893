"""Tiers for the optimizer's state: memory, or a file on a local disk (ZeRO-Infinity's NVMe
tier). `state_store` picks one from the config; the engine steps through it and never
knows where the bytes were."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch

from ..config import ZeroConfig
from ..optimizer import OptimizerView
from .offload_file import OffloadError, OffloadFile, check_directory
from .state_store import DiskState, ResidentState

__all__ = ["DiskState", "OffloadError", "ResidentState", "state_store"]


def state_store(
    config: ZeroConfig,
    state: MutableMapping[Any, Any],
    views: Sequence[OptimizerView],
    device: torch.device,
    rank: int,
    on_memory: Callable[[], None] = lambda: None,
) -> ResidentState | DiskState:
    """The store of `config.offload_optimizer` for this rank's optimizer state;
    `on_memory` is told when its host buffers are taken or given back."""
    tier = config.offload_optimizer
    if tier != "none" and device.type != "cpu":
        raise OffloadError(
            f"offload_optimizer={tier!r} runs the optimizer step on the CPU and is "
            f"implemented for CPU training devices only so far; this engine trains on "
            f"{device}. Use offload_optimizer='none' there."
        )
    if tier != "disk":  # "cpu" on a CPU device: the state is in host memory already
        return ResidentState(state)
    directory = check_directory(config.offload_dir, "offload_optimizer='disk'")
    name = f"zero-optimizer-rank{rank:05d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
    return DiskState(
        state,
        views,
        OffloadFile(directory, name),
        config.offload_tile_size,
        config.offload_buffer_count,
        on_memory,
    )
