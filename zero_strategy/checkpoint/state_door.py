"""The state door: every way the model's state leaves or enters the engine.

Sharded checkpoints (save, load at any world size and stage), Hugging Face pretrained
weights read by byte ranges, the consolidated full state dict streamed unit by unit, and
each unit's full fp32 values (for `release_module`). The engine settles its work in
flight before it opens the door; the door reads and writes shards, never schedules.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..comm.topology import ProcessGroups
from ..layout.partition import Stored
from ..moe.expert_placement import ExpertNames
from ..optim.optimizer_set import OptimizerSet
from ..optim.step_lag import StepLags
from ..tensor_parallel import full_tensor, match_local_dtype
from ..units.flat_unit import FlatUnit
from ..units.optimizer_view import OptimizerView
from .format import LoadedCheckpoint, ShardedState, persistent_buffers
from .full_optimizer import full_optimizer_state
from .load import load
from .one_file_writer import save_one_file
from .pretrained import load_pretrained
from .save import save


class StateDoor:
    def __init__(
        self,
        units: Sequence[FlatUnit],
        module: nn.Module,
        optimizer_set: OptimizerSet,
        views: list[OptimizerView],
        state_store,
        groups: ProcessGroups,
        stage: int,
        device: torch.device,
        tensor_sharded: dict[str, Any],
        expert_names: ExpertNames,
        step_lags: StepLags,
    ):
        self.units = units
        self.module = module
        self.optimizer_set = optimizer_set
        self.views = views
        self.state_store = state_store
        self.groups = groups
        self.stage = stage
        self.device = device
        # Tensor-parallel shards, by every name: checkpointed as blocks of the full tensor.
        self._tensor_sharded = tensor_sharded
        self._expert_names = expert_names
        self._step_lags = step_lags  # the optimizer's: saved and loaded with its state

    # ---------------------------------------------------------------- names
    def stored(
        self, unit: FlatUnit, name: str, shape: tuple[int, ...], copy: int | None = None
    ) -> Stored:
        """Where a parameter is checkpointed and consolidated: under its own name, or for
        a distinct copy (`copy`, default this rank's: an expert-parallel rank's experts)
        under its global name, or as its rows of a batched weight."""
        placed = self._tensor_sharded.get(name)  # this position's block of the full tensor
        if not unit.group.spec.replicated:
            copy = unit.group.copy_index if copy is None else copy
            expert = self._expert_names.stored(name, copy, tuple(shape))
            if placed is None:
                return expert
            # Split by tensor parallelism too: one expert's own parameter, never rows of
            # a batched one (`settle_expert_parallel` refuses those).
            return Stored(expert.name, placed.full_shape, placed.offset)
        if placed is not None:
            return Stored(name, placed.full_shape, placed.offset)
        return Stored(name, tuple(shape))

    def parameter_names(self) -> set[str]:
        """Every name (tied aliases included) under which the model holds a parameter."""
        return {
            name
            for unit in self.units
            for slot in unit.layout.slots
            for name in (slot.name, *slot.aliases)
        }

    def model_names(self) -> set[str]:
        """The stored names of the whole model: this rank's, and the experts of every
        other expert-parallel rank."""
        return {
            self.stored(unit, name, slot.shape, copy).name
            for unit in self.units
            for slot in unit.layout.slots
            for name in (slot.name, *slot.aliases)
            for copy in range(unit.group.spec.copies)
        }

    # ---------------------------------------------------------------- checkpoints
    def _sharded_state(self) -> ShardedState:
        return ShardedState(
            self.units,
            self.optimizer_set,
            self.views,
            self.module,
            self.groups.everyone,  # every rank writes its file (all tensor positions too)
            self.stage,
            self.device,
            self.stored,
            self.model_names(),
            self.state_store,
            self.groups.tensor.rank if self.groups.tensor is not None else 0,
            self._step_lags,
        )

    def save(
        self,
        path: str | os.PathLike,
        *,
        one_file: bool = False,
        keys: dict | None = None,
        **meta: Any,
    ) -> None:
        """Write a sharded checkpoint directory, or with `one_file` one torch file, every
        rank its own ranges (collective). `meta`: step, compute dtype, loss scaler and
        client state, as `save.save` takes them; `keys`: the one file's layout (Fabric's
        names for the model and optimizers; Lightning's when None)."""
        if one_file:
            save_one_file(self._sharded_state(), path, keys=keys, **meta)
        else:
            save(self._sharded_state(), path, **meta)

    def load(self, path: str | os.PathLike, load_optimizer_states: bool) -> LoadedCheckpoint:
        """Read a checkpoint written at any world size and stage into the masters (and
        the optimizer state); the caller refreshes the compute copies."""
        return load(self._sharded_state(), path, load_optimizer_states)

    def load_pretrained(
        self, path: str | os.PathLike, strict: bool, into: str | None = None
    ) -> dict[str, int]:
        """Safetensors weights into the masters, each rank reading its own ranges."""
        return load_pretrained(
            self.units, self.module, path, strict, self.stored, into, self.model_names()
        )

    # ---------------------------------------------------------------- whole values
    def full_state_dict(
        self, rank0_only: bool = True, trainable_only: bool = False
    ) -> dict[str, torch.Tensor]:
        """The consolidated fp32 model (parameters from the masters, plus persistent
        buffers) in CPU memory, gathered one unit at a time; empty on other ranks when
        `rank0_only`. With `trainable_only`, the parameters the optimizer trains alone (a
        LoRA adapter): only their units are gathered. Collective."""
        out: dict[str, torch.Tensor] = {}
        keep = not rank0_only or self.groups.global_rank == 0
        for unit in self.units:
            if not unit.layout.numel and not any(s.tensor_sharded for s in unit.layout.slots):
                continue  # (a block may be empty here and not at another position)
            if trainable_only and not unit.layout.trainable:
                continue
            for copy_index, full in self._full_copies(unit):
                self._add_unit(out, unit, copy_index, full, keep, trainable_only)
        if not keep:
            return {}
        if trainable_only:
            return out
        for name, buf in persistent_buffers(self.module):
            out[name] = buf.detach().to("cpu", copy=True)
        return out

    def full_optimizer_state(self, optimizer: Any, rank0_only: bool = True) -> dict[str, Any]:
        """torch's `state_dict()` of `optimizer` (None: the only one), whole, in CPU
        memory (collective)."""
        position = self.optimizer_set.position_of(optimizer)
        return full_optimizer_state(self._sharded_state(), position, rank0_only)

    def _add_unit(
        self,
        out: dict[str, torch.Tensor],
        unit: FlatUnit,
        copy_index: int,
        full: torch.Tensor,
        keep: bool,
        trainable_only: bool = False,
    ) -> None:
        """One copy of one unit's parameters into `out` (tensor-parallel blocks are
        assembled on every rank: a collective)."""
        for slot in unit.layout.slots:
            if trainable_only and not slot.trainable:
                continue  # (the same on every rank: its tensor-parallel assembly too)
            if slot.tensor_sharded:  # every position's block (collective)
                value = full_tensor(
                    full[slot.offset : slot.end].view(slot.shape), slot.tensor, self.groups.tensor
                )
                for name in (slot.name, *slot.aliases) if keep else ():
                    out[self.stored(unit, name, slot.shape, copy_index).name] = value
                continue
            if not keep:
                continue
            value = full[slot.offset : slot.end].to("cpu", copy=True)
            for name in (slot.name, *slot.aliases):
                stored = self.stored(unit, name, slot.shape, copy_index)
                if tuple(stored.shape) == tuple(slot.shape):
                    out[stored.name] = value.view(slot.shape)
                    continue
                # A batched expert weight: this copy's rows of the whole tensor.
                whole = out.setdefault(stored.name, torch.empty(stored.shape, dtype=value.dtype))
                whole.view(-1)[stored.offset : stored.offset + slot.numel] = value

    @torch.no_grad()
    def hand_back(self) -> None:
        """Every parameter becomes a full tensor of its fp32 master values on this rank
        (this rank's experts for MoE layers), with no gradient: the model leaves the
        engine as a plain module. Collective at stages 1-3."""
        for unit in self.units:
            full = self.full_values(unit)
            for slot, p, local in zip(unit.layout.slots, unit.params, unit.locals):
                local.data = full[slot.offset : slot.end].view(slot.shape).clone()
                match_local_dtype(p)
                p.grad = None

    def full_values(self, unit: FlatUnit) -> torch.Tensor:
        """The unit's full fp32 values (padded), identical across its shard group."""
        if self.stage == 0:
            with unit.master_resident():  # a copy of an offloaded one: it leaves after
                return unit.master.to(self.device, copy=unit.master_offloaded)
        full = torch.empty(unit.layout.padded_numel, dtype=unit.master_dtype, device=self.device)
        with unit.master_resident():
            unit.group.comm.all_gather(full, unit.master.to(self.device))
        return full

    def _full_copies(self, unit: FlatUnit) -> Iterator[tuple[int, torch.Tensor]]:
        """(copy index, full fp32 values) of each copy this rank needs to see: its own, or
        for distinct copies every one in turn (sent over the ranks at this rank's position
        in every copy), so that rank 0 ends with every expert."""
        full = self.full_values(unit)
        group = unit.group
        if group.spec.replicated or group.replicas is None:
            yield group.copy_index, full
            return
        for copy_index in range(group.spec.copies):
            value = full if copy_index == group.copy_index else torch.empty_like(full)
            group.replicas.broadcast(value, src=copy_index)
            yield copy_index, value
