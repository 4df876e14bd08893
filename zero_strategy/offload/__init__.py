"""Tiers for the optimizer's state, the fp32 masters, the gradients' fp32 shards and stage
3's parameter shards: memory, or a file on a local disk (ZeRO-Infinity's NVMe tier). The
`*_store` factories pick one from the config; the engine steps and gathers through them
and never knows where the bytes were. Which memory holds each kind (the device's or the
host's) is `rules`'."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import ZeroConfig
from ..units.flat_unit import FlatUnit
from ..units.optimizer_view import OptimizerView
from .failures import agree_on_write_failures
from .grad_store import DiskGrads
from .host_memory import free_large_blocks_at_once
from .offload_file import OffloadError, OffloadFile, check_directory
from .rules import (
    keeps_stage_3,
    offloads_gradients,
    offloads_masters,
    optimizer_host,
    parameters_host,
)
from .shard_store import DiskShards, master_alone
from .staging import StagingBuffers
from .state_store import DiskState, ResidentState

__all__ = [
    "DiskGrads",
    "DiskShards",
    "DiskState",
    "OffloadError",
    "ResidentState",
    "StagingBuffers",
    "UnitTiers",
    "agree_on_write_failures",
    "free_large_blocks_at_once",
    "grad_store",
    "keeps_stage_3",
    "master_store",
    "offloads_gradients",
    "offloads_masters",
    "optimizer_host",
    "parameters_host",
    "shard_store",
    "state_store",
    "unit_tiers",
]


def state_store(
    config: ZeroConfig,
    state: MutableMapping[Any, Any],
    views: Sequence[OptimizerView],
    rank: int,
    on_memory: Callable[[], None] = lambda: None,
) -> ResidentState | DiskState:
    """The store of `config.offload_optimizer` for this rank's optimizer state;
    `on_memory` is told when its host buffers are taken or given back."""
    if config.offload_optimizer != "disk":
        return ResidentState(state)  # "cpu": in host memory already, where the step runs
    return DiskState(
        state,
        views,
        _file(config, "offload_optimizer", "optimizer", rank),
        config.offload_tile_size,
        config.offload_buffer_count,
        on_memory,
    )


def shard_store(
    config: ZeroConfig,
    units: Sequence[FlatUnit],
    rank: int,
    staging: StagingBuffers,
    on_memory: Callable[[], None] = lambda: None,
) -> DiskShards | None:
    """Stage 3 with offload_params="disk": the tier that keeps `units`' shards (those not
    kept gathered) in a file between uses, through the `staging` buffers; None when they
    stay in memory."""
    if config.offload_params != "disk":
        return None
    offloaded = [u for u in units if not u.persistent and u.layout.numel]
    shards = DiskShards(
        offloaded,
        _file(config, "offload_params", "params", rank),
        staging,
        on_memory,
    )
    for unit in offloaded:
        unit.keep_shard_in(shards)
    return shards


def grad_store(
    config: ZeroConfig,
    units: Sequence[FlatUnit],
    stage: int,
    rank: int,
    staging: StagingBuffers,
    on_memory: Callable[[], None] = lambda: None,
) -> DiskGrads | None:
    """The tier that keeps `units`' fp32 gradient shards in a file between their
    reduction and the step (`offloads_gradients`), through the `staging` buffers; None
    when they stay in memory."""
    if not offloads_gradients(config, stage):
        return None
    offloaded = [u for u in units if u.grad_opt is not None and u.grad_opt.numel()]
    grads = DiskGrads(
        offloaded,
        _file(config, "offload_optimizer", "grads", rank),
        staging,
        on_memory,
    )
    for unit in offloaded:
        unit.keep_grads_in(grads)
    return grads


def master_store(
    config: ZeroConfig,
    units: Sequence[FlatUnit],
    rank: int,
    staging: StagingBuffers,
    on_memory: Callable[[], None] = lambda: None,
) -> DiskShards | None:
    """The tier that keeps `units`' fp32 masters in a file between the steps, checkpoints
    and weight writes that use them (`offloads_masters`), through the `staging` buffers;
    None when they stay in memory. Made before `shard_store`, which then keeps the
    compute copies alone."""
    if config.offload_optimizer != "disk":
        return None
    offloaded = [u for u in units if u.master_apart and u.master is not None and u.master.numel()]
    if not offloaded:  # fp32 on the CPU: each master is the compute copy
        return None
    masters = DiskShards(
        offloaded,
        _file(config, "offload_optimizer", "masters", rank),
        staging,
        on_memory,
        tensors_of=master_alone,
        what="fp32 master weights",
        kind="master_params",
    )
    for unit in offloaded:
        unit.keep_master_in(masters)
    return masters


@dataclass(frozen=True)
class UnitTiers:
    """The per-unit disk tiers of one engine; None where those tensors stay in memory."""

    masters: DiskShards | None
    shards: DiskShards | None
    grads: DiskGrads | None

    def present(self) -> list[DiskShards | DiskGrads]:
        return [t for t in (self.masters, self.shards, self.grads) if t is not None]


def unit_tiers(
    config: ZeroConfig,
    units: Sequence[FlatUnit],
    stage: int,
    rank: int,
    staging: StagingBuffers,
    on_memory: Callable[[], None] = lambda: None,
) -> UnitTiers:
    """Each unit's fp32 master (`master_store`), stage 3's parameter shard (`shard_store`)
    and fp32 gradient shard (`grad_store`) in files where the config says so, all through
    the `staging` buffers. Once the units are final: stage 3's gatherer has decided which
    stay gathered, and those stay in memory."""
    args = (rank, staging, on_memory)
    return UnitTiers(
        master_store(config, units, *args),
        shard_store(config, units, *args),
        grad_store(config, units, stage, *args),
    )


def _file(config: ZeroConfig, field_name: str, what: str, rank: int) -> OffloadFile:
    directory = check_directory(config.offload_dir, f"{field_name}='disk'")
    name = f"zero-{what}-rank{rank:05d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
    return OffloadFile(directory, name)
