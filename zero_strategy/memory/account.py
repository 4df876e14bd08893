"""One rank's memory account: what `memory_report()` says, and the peaks behind it.

The account is opened before the engine's parts exist (they are told to `sample()` after
each change to their transient memory) and is handed its sources once they do
(`watch`). It reads them; it changes nothing.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..offload import UnitTiers
from ..units.flat_unit import FlatUnit
from .accounting import held_bytes, memory_report
from .peaks import MemoryPeaks


@dataclass(frozen=True)
class Sources:
    """What holds this rank's memory."""

    units: Sequence[FlatUnit]
    optimizer: Any  # ShardedOptimizer: its views, their state and the state's tier
    schedule: Any  # UnitSchedule: the reducer's buffers, stage 3's gathered units
    tiers: UnitTiers  # the per-unit disk tiers
    staging: Any  # the disk tiers' shared host buffers
    module: nn.Module  # its buffers
    stage: int
    device: torch.device
    host: torch.device  # where the optimizer's side lives (another memory on a GPU)


class MemoryAccount:
    def __init__(self) -> None:
        self._sources: Sources | None = None
        self.peaks = MemoryPeaks(self._held_bytes, self._transient_bytes)

    def watch(self, sources: Sources) -> None:
        """Start counting: the parts exist; the peaks start from what they hold."""
        self._sources = sources
        self.peaks.reset()

    def sample(self) -> None:
        self.peaks.sample()

    def resync(self) -> None:
        self.peaks.resync()

    def report(self) -> dict[str, int]:
        s = self._sources
        return memory_report(
            self._held_bytes(),
            s.optimizer.optimizer_set,
            s.stage,
            expert_units=[u for u in s.units if not u.group.spec.replicated],
            expert_params=[v.param for v in s.optimizer.views if not v.unit.group.spec.replicated],
            peaks=self.peaks.peaks,
            disk=self._disk_bytes(),
            device=s.device,
        )

    def timeline(self) -> list[tuple[float, dict[str, int]]]:
        return list(self.peaks.timeline or ())

    def _disk_bytes(self) -> dict[str, int]:
        """Bytes in the offload files by kind, summed over the tiers."""
        s = self._sources
        disk = collections.Counter({"optimizer_state": s.optimizer.state_store.disk_bytes()})
        for tier in s.tiers.present():
            disk.update(tier.disk_bytes())
        return dict(disk)

    def _transient_bytes(self) -> dict[str, int]:
        s = self._sources
        comm, pooled = s.schedule.reducer.transient_bytes()
        gathered = 0
        if s.schedule.gather is not None:
            gathered = s.schedule.gather.gathered_bytes()
            pooled += s.schedule.gather.storage_pool.spare_bytes
        transient = {"gathered_parameters": gathered, "comm_buffers": comm, "pooled": pooled}
        # The disk tiers' buffers, and the masters and gradient shards they bring in, are
        # in host memory: another memory than the device's on an accelerator.
        host = "host_" if s.host != s.device else ""
        offload_buffers = sum(b.numel() for b in self._offload_buffers())
        transient[f"{host}pooled"] = transient.get(f"{host}pooled", 0) + offload_buffers
        landing = s.schedule.reducer.host_landings.nbytes()  # reduced gradients on their way
        transient[f"{host}comm_buffers"] = transient.get(f"{host}comm_buffers", 0) + landing
        if s.tiers.grads is not None:  # offloaded gradient shards come and go in backward
            transient[f"{host}gradients"] = s.tiers.grads.resident_bytes()
        if s.tiers.masters is not None:  # offloaded masters come and go in the step
            transient[f"{host}master_params"] = s.tiers.masters.resident_bytes
        return transient

    def _offload_buffers(self) -> list[torch.Tensor]:
        s = self._sources
        return [
            *s.optimizer.state_store.buffers(),
            *s.staging.free,
            *(b for tier in s.tiers.present() for b in tier.buffers()),
        ]

    def _held_bytes(self) -> dict[str, int]:
        s = self._sources
        return held_bytes(
            list(s.units),
            s.optimizer.optimizer_set,
            s.module,
            s.stage,
            comm_tensors=s.schedule.reducer.comm_buffers(),
            pooled_tensors=[*s.schedule.reducer.pooled_buffers(), *self._offload_buffers()],
            pooled_storages=s.schedule.gather.storage_pool.storages() if s.schedule.gather else [],
            device=s.device,
        )
