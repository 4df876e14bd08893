"""Sharded checkpoints that load at any world size and stage.

A checkpoint is a directory:

    index.json                  layout, world size, stage, step, optimizer hyperparameters,
                                and for every parameter which rank file holds which range
    rank00000.safetensors ...   what each rank owned: fp32 master ranges and the matching
                                elementwise optimizer state ("<state>/<name>"; a later
                                optimizer's over a parameter an earlier one steps too:
                                "<state>@group<g>/<name>"), no pickle
    client_state.pt             optional, rank 0: trainer state, torch.load(weights_only=True)

Every range is in the coordinates of the flattened parameter, so the reader needs nothing
of the writer's unit or bucket layout: each rank of the new world computes the ranges its
new shard needs and reads just those slices. A save is atomic: files go to a temporary
directory that is renamed into place once every rank has written and the index is
complete; an interrupted save leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..layout.partition import ParamSlot, Stored
from ..offload.state_store import OptimizerStateStore
from ..optim.optimizer_set import OptimizerSet
from ..optim.step_lag import StepLags
from ..private_api import persistent_direct_buffers
from ..units.flat_unit import FlatUnit
from ..units.optimizer_view import OptimizerView
from . import atomic_dir
from .safe_load import CheckpointError

FORMAT = "zero-strategy/1"


INDEX = "index.json"


MASTER_DTYPES = (torch.float32, torch.float64)  # masters: fp32, or fp64 by fp64 training


CLIENT_STATE = "client_state.pt"


RESTORE = "Restore the checkpoint from where it was written, or load an earlier one."


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


@dataclass
class ShardedState:
    """What a checkpoint reads and writes, handed over by the engine."""

    units: list[FlatUnit]
    optimizer: OptimizerSet  # every optimizer of the engine, as one
    views: list[OptimizerView]  # the optimizer's parameters, one per (unit, group) segment
    module: nn.Module  # for its persistent buffers
    world: Communicator  # every rank: barriers and the index exchange
    stage: int
    device: torch.device  # where control tensors go (an NCCL group refuses CPU ones)
    # Where a parameter (unit, name, shape) is stored: a tensor's name, shape and the
    # parameter's offset in it (experts: global ids, or rows of a batched weight).
    stored: Callable[[FlatUnit, str, tuple[int, ...]], Stored]
    model_names: set[str]  # every rank's stored names (other expert-parallel ranks' experts)
    # Where the optimizer's elementwise state is read and put (memory or the disk tier).
    optimizer_state: OptimizerStateStore
    # Tensor parallelism: this rank's position (parameters whole on every position are
    # written by position 0 alone; `world` is then every rank, numbered globally).
    tensor_position: int = 0
    # How far each parameter's step count is behind its param group's (`optim/step_lag`).
    step_lags: StepLags = field(default_factory=StepLags)


@dataclass
class LoadedCheckpoint:
    step: int
    loss_scaler: dict[str, Any]
    client_state: dict | None


# ============================================================================ saving
def _stored_names(state: ShardedState) -> dict[tuple[int, int], str]:
    """The stored name of each of this rank's parameters, by (unit index, slot index)."""
    return {
        (unit.layout.index, index): state.stored(unit, slot.name, slot.shape).name
        for unit in state.units
        for index, slot in enumerate(unit.layout.slots)
    }


def step_lags_by_name(state: ShardedState) -> list[dict[str, int]]:
    """Per param group, {stored name: lag} of this rank's parameters behind their
    group's step count."""
    names = _stored_names(state)
    return state.step_lags.by_name(
        lambda unit, slot: names[unit, slot], len(state.optimizer.param_groups)
    )


def slots_by_name(state: ShardedState) -> dict[str, list[tuple[int, int]]]:
    """Each stored name of this rank's parameters: its (unit index, slot index)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for key, name in _stored_names(state).items():
        out.setdefault(name, []).append(key)
    return out


def param_order(state: ShardedState) -> list[list[str]]:
    """Per param group, the stored names of this rank's parameters in the optimizer's
    order: a one-file checkpoint lists each group's parameters as torch does."""
    stored = {
        id(p): state.stored(unit, slot.name, slot.shape).name
        for unit in state.units
        for slot, p in zip(unit.layout.slots, unit.params)
    }
    return [
        list(dict.fromkeys(stored[id(p)] for p in params if id(p) in stored))
        for params in state.optimizer.built_with
    ]


def owned_pieces(state: ShardedState) -> Iterator[tuple[FlatUnit, ParamSlot, int, int]]:
    """(unit, slot, lo, hi) for every range of a parameter this rank writes; ranges are in
    flattened-parameter coordinates. Each element is written once: by the ranks of the
    first copy of its unit, or at stage 0 (replicated) by rank 0 alone."""
    for unit in state.units:
        if not unit.group.primary:
            continue
        if state.stage == 0:  # replicated: a copy's first rank writes it (rank 0, or each
            if unit.group.rank != 0:  # expert-parallel rank's first holder of its experts)
                continue
            start, end = 0, unit.layout.padded_numel
        else:
            start, end = unit.layout.shard_range(unit.rank)
        for slot in unit.layout.slots:
            if state.tensor_position and not slot.tensor_sharded:
                continue  # the same values at every tensor-parallel position
            lo, hi = max(start, slot.offset), min(end, slot.end)
            if lo < hi:
                yield unit, slot, lo - slot.offset, hi - slot.offset


def views_covering(
    views: list[OptimizerView], unit: FlatUnit, lo: int, hi: int, group: int
) -> list[OptimizerView]:
    """Param group `group`'s optimizer views holding [lo, hi) of `unit`'s slice (slice
    coordinates), in order: one, or several where the views were cut into tiles
    (offloaded state)."""
    found = sorted(
        (
            v
            for v in views
            if v.unit is unit and v.group_index == group and v.lo < hi and lo < v.hi and v.hi > v.lo
        ),
        key=lambda v: v.lo,
    )
    at = lo
    for view in found:
        if view.lo > at:
            return []  # a gap: no view holds these elements (a frozen range)
        at = max(at, view.hi)
    return found if at >= hi else []


def located(path: str | os.PathLike) -> Path:
    """The checkpoint at `path`; the previous one when the save that was replacing it was
    killed between its two renames (platforms without an atomic directory swap)."""
    path = Path(path)
    found = atomic_dir.resolve(path)
    if found != path:
        warnings.warn(
            f"{path} is missing and {found.name} beside it is whole: the save that was "
            "replacing it was interrupted. Loading the previous checkpoint; the next save "
            "to this path clears it.",
            stacklevel=3,
        )
    return found


def read_index(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is not a directory; a zero-strategy checkpoint is one. Pass the "
            f"directory that save_checkpoint wrote (it holds {INDEX})."
        )
    index_path = path / INDEX
    if not index_path.exists():
        raise CheckpointError(
            f"{path} has no {INDEX}: it is not a complete zero-strategy checkpoint (an "
            "interrupted save leaves only a '.tmp' directory). Load a checkpoint written by "
            "engine.save_checkpoint."
        )
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{index_path} is not valid JSON ({e}); the checkpoint is corrupt."
        ) from e
    if index.get("format") != FORMAT or not index.get("complete"):
        raise CheckpointError(f"{index_path} is not a complete '{FORMAT}' index.")
    _check_file_names(path, index)
    missing = [f for f in index["files"] if not (path / f).exists()]
    if missing:
        raise CheckpointError(
            f"Checkpoint {path} is incomplete: missing {missing} (written by ranks "
            f"{[index['files'].index(f) for f in missing]} of {index['world_size']}). {RESTORE}"
        )
    return index


def _check_file_names(path: Path, index: dict[str, Any]) -> None:
    """A checkpoint is untrusted input: its index may name only the rank files of its own
    world size, and none of them may lead out of the directory (through `..`, an absolute
    path, or a symlink)."""
    world = index.get("world_size")
    files = index.get("files")
    if not isinstance(world, int) or world < 1 or not isinstance(files, list):
        raise CheckpointError(f"{path / INDEX} has no valid world_size and files list.")
    expected = [rank_file(r) for r in range(world)]
    if files != expected:
        odd = [f for f in files if f not in expected] or files
        raise CheckpointError(
            f"{path / INDEX} names files {odd[:3]}; a checkpoint of {world} ranks holds exactly "
            f"{expected[:3]}{'...' if world > 3 else ''} in its own directory. Refusing it: "
            f"{RESTORE}"
        )
    root = path.resolve()
    for name in files:
        target = (path / name).resolve()
        if target.parent != root:
            raise CheckpointError(
                f"{path / name} leads out of the checkpoint directory (to {target}); a "
                "checkpoint's files must be in its own directory (copy the files, not links). "
                f"Refusing it: {RESTORE}"
            )


def stored_blocks(entry: dict[str, Any]) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """A tensor-parallel parameter's stored blocks (None: stored whole)."""
    tp = entry.get("tensor_parallel")
    if tp is None:
        return None
    return [(tuple(a), tuple(b)) for a, b in tp["blocks"]]


def persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mod_name, module in model.named_modules():
        for name, buf in persistent_direct_buffers(module):
            yield (f"{mod_name}.{name}" if mod_name else name), buf
