"""Exact accounting of the bytes one rank holds, by kind.

Counted by storage, each storage once, so views (a stage-1 master that is a slice of the
full parameters, a gradient slice of the flat gradient buffer) are never counted twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .engine import ZeroEngine


KINDS = (
    "parameters",
    "master_params",
    "gradients",
    "optimizer_state",
    "gathered_parameters",
    "comm_buffers",
    "buffers",
)


class _Ledger:
    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = dict.fromkeys(KINDS, 0)

    def add(self, kind: str, tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            self.add_storage(kind, tensor.untyped_storage())

    def add_storage(self, kind: str, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.bytes[kind] += storage.nbytes()


def memory_report(engine: ZeroEngine) -> dict[str, int]:
    """parameters: compute-dtype parameters held persistently (full at stages 0-2, the
    shard at stage 3); master_params: fp32 masters not shared with them; gradients;
    optimizer_state; gathered_parameters: stage-3 units gathered right now; comm_buffers:
    full-size gradient buffers being filled or reduced, and the pools that recycle them
    and stage 3's gather memory;
    buffers: the model's buffers. `total` sums them."""
    ledger = _Ledger()
    stage = engine.config.stage
    for unit in engine.units:
        ledger.add("parameters", unit.full if stage < 3 else unit.shard)
    for unit in engine.units:
        ledger.add("master_params", unit.master)
    for unit in engine.units:
        ledger.add("gradients", unit.grad_opt)
        if stage < 2:
            ledger.add("gradients", unit.grad_full)
    for state in engine.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                ledger.add("optimizer_state", value)
    for unit in engine.units:
        if stage == 3 and unit.gathered_bytes():
            ledger.add("gathered_parameters", unit.full if unit.full is not None else unit._buf)
        if stage >= 2:
            ledger.add("comm_buffers", unit.grad_full)
    for job in engine.reducer.in_flight:
        ledger.add("comm_buffers", job.sent)
    for buf in engine.reducer.pool.tensors():
        ledger.add("comm_buffers", buf)
    if engine.gather is not None:
        for storage in engine.gather.storage_pool.storages():
            ledger.add_storage("comm_buffers", storage)
    for buf in engine.module.buffers():
        ledger.add("buffers", buf)
    report = dict(ledger.bytes)
    report["total"] = sum(report.values())
    return report
