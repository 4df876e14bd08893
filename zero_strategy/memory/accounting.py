"""Exact accounting of the bytes one rank holds, by kind.

Counted by storage, each storage once, so views (a stage-1 master that is a slice of the
full parameters, a gradient slice of the flat gradient buffer) are never counted twice.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..optim.optimizer_set import OptimizerSet
from ..units.flat_unit import FlatUnit

MODEL_STATE = ("parameters", "master_params", "gradients", "optimizer_state")
KINDS = (
    "parameters",
    "master_params",
    "gradients",
    "optimizer_state",
    "gathered_parameters",
    "comm_buffers",
    "pooled",
    "buffers",
)


class _Ledger:
    """Bytes by kind on the training device, and (`host`) in host memory when that is
    another memory: the optimizer's side offloaded from an accelerator."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.host: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.apart = device is not None and device.type != "cpu"

    def add(self, kind: str, tensor: torch.Tensor | None) -> None:
        if tensor is not None and not tensor.is_meta:  # meta: offloaded state's placeholder
            on_host = self.apart and tensor.device.type == "cpu"
            self.add_storage(kind, tensor.untyped_storage(), on_host)

    def add_storage(self, kind: str, storage: torch.UntypedStorage, on_host: bool = False) -> None:
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in self.seen:
            return
        self.seen.add(key)
        (self.host if on_host else self.bytes)[kind] += storage.nbytes()


def _add_model_state(
    ledger: _Ledger, units: list[FlatUnit], states: Iterable[dict], stage: int
) -> None:
    for unit in units:
        ledger.add("parameters", unit.full if stage < 3 else unit.shard)
    for unit in units:
        ledger.add("master_params", unit.master)
    for unit in units:
        ledger.add("gradients", unit.grad_opt_untouched)
        if stage < 2:
            ledger.add("gradients", unit.grad_full)
    for state in states:
        for value in state.values():
            if isinstance(value, torch.Tensor):
                ledger.add("optimizer_state", value)


def held_bytes(
    units: list[FlatUnit],
    optimizer: OptimizerSet,
    module: nn.Module,
    stage: int,
    comm_tensors: Iterable[torch.Tensor] = (),
    pooled_tensors: Iterable[torch.Tensor] = (),
    pooled_storages: Iterable[torch.UntypedStorage] = (),
    device: torch.device | None = None,
) -> dict[str, int]:
    """The bytes of each kind held now, and their `total` (see `memory_report`): the
    tensors in flight (`comm_tensors`) and those kept idle for reuse (`pooled_*`) come
    from the engine's reducer and gatherer. On an accelerator `device`, model state in
    host memory is `host_<kind>` (and `host_total`), in no other figure."""
    ledger = _Ledger(device)
    _add_model_state(ledger, units, optimizer.state.values(), stage)
    for unit in units:
        if stage == 3 and unit.gathered_bytes():
            for storage in unit.gathered_storages():
                ledger.add_storage("gathered_parameters", storage)
        if stage >= 2:
            ledger.add("comm_buffers", unit.grad_full)
    for tensor in comm_tensors:
        ledger.add("comm_buffers", tensor)
    for tensor in pooled_tensors:
        ledger.add("pooled", tensor)
    for storage in pooled_storages:
        ledger.add_storage("pooled", storage)
    for buf in module.buffers():
        ledger.add("buffers", buf)
    report = dict(ledger.bytes)
    report["total"] = sum(report.values())
    if ledger.apart:
        report.update({f"host_{kind}": ledger.host[kind] for kind in KINDS})
        report["host_total"] = sum(ledger.host.values())
    return report


def memory_report(
    held: dict[str, int],
    optimizer: OptimizerSet,
    stage: int,
    expert_units: Iterable[FlatUnit] = (),
    expert_params: Iterable[torch.Tensor] = (),
    peaks: dict[str, int] | None = None,
    disk: dict[str, int] | None = None,
    device: torch.device | None = None,
) -> dict[str, int]:
    """`held` (from `held_bytes`) with the experts' part, the peaks and the disk tier
    added.

    parameters: compute-dtype parameters held persistently (full at stages 0-2, the
    shard at stage 3); master_params: fp32 masters not shared with them; gradients;
    optimizer_state; gathered_parameters: stage-3 units gathered right now; comm_buffers:
    gradient buffers being filled or reduced; pooled: idle memory kept for reuse
    (gradient buffers, and stage 3's gather memory), and during a step the disk tier's
    host buffers; buffers: the model's buffers.
    `total` sums them.

    With MoE experts (`expert_units`, and the optimizer parameters over them),
    `expert_<kind>` is the experts' part of each model-state kind, already counted in the
    kind itself (and so not in `total` twice).

    `peaks` (kind -> bytes) adds `peak_<kind>` and `peak_total`: the most held at once
    since the peaks were last reset; `peak_total` is the largest total, not the sum of
    the kinds' peaks (which need not coincide).

    `disk` (kind -> bytes) adds `disk_<kind>` and `disk_total`: what is offloaded to files
    (offload_optimizer="disk"), in no other figure. The kinds above are in memory: the
    training device's, which is the host's when training on the CPU. On an accelerator
    `device` what is in host memory (the optimizer's side offloaded, the disk tiers'
    buffers) is `host_<kind>` and `host_total`, in no other figure either."""
    report = dict(held)
    expert_units = list(expert_units)
    if expert_units:
        states = [optimizer.state.get(p, {}) for p in expert_params]
        part = _Ledger(device)
        _add_model_state(part, expert_units, states, stage)
        report.update({f"expert_{kind}": part.bytes[kind] for kind in MODEL_STATE})
    disk = disk or {}
    report.update({f"disk_{kind}": disk.get(kind, 0) for kind in MODEL_STATE})
    report["disk_total"] = sum(disk.values())
    if peaks is not None:
        report.update(
            {f"peak_{kind}": max(peaks.get(kind, 0), report[kind]) for kind in (*KINDS, "total")}
        )
    return report
