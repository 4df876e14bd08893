"""Each optimizer's whole state in memory, as torch's `optimizer.state_dict()` of an
unsharded optimizer has it: what `Strategy.optimizer_state()` hands a user under DDP.

The one-file checkpoint's plan says what there is (`plan_optimizer`: every parameter's
elementwise state, in the optimizer's order); every rank reports the ranges it owns, as
for a save, and each tensor is assembled from them one at a time (a sum of disjoint
ranges), so no rank holds more than one parameter's state besides what it returns.
Parameters are numbered as torch numbers them, group after group.

Each parameter's step count is its own, as torch's (its group's less the steps it
missed: `optim/step_lag`), and one that never took a step has no entry. Where it is not
torch's: the hyperparameters are those a checkpoint records (JSON: a tensor learning rate
comes back a float).
"""

from __future__ import annotations

from typing import Any

import torch

from ..units.flat_unit import OneResident
from .consolidate import optimizer_states, plan_optimizer
from .format import ShardedState
from .one_file_writer import KnownState
from .safe_load import CheckpointError
from .save import build_index, reported_tensors


def full_optimizer_state(
    state: ShardedState, position: int, rank0_only: bool = True
) -> dict[str, Any]:
    """torch's `state_dict()` of the engine's optimizer at `position`, in CPU memory (an
    empty dict on ranks other than 0 when `rank0_only`). Collective."""
    if any(s.tensor_sharded for u in state.units for s in u.layout.slots):
        raise CheckpointError(
            "The whole optimizer state of a tensor-parallel model is not assembled in "
            "memory; save a checkpoint with state_dict_type='full' (or consolidate a "
            "sharded one) and read its optimizer_states."
        )
    world = state.world
    keep = not rank0_only or world.rank == 0
    in_memory = OneResident()
    try:
        tensors, written, reports = reported_tensors(state, in_memory)
        index = build_index(state, reports, 0, torch.float32, {})
        names = {n for r in reports for n in r["tensors"]}
        known = KnownState(None, index, names, None, {})
        counts = index["optimizer"]["groups_per_optimizer"]
        first = sum(counts[:position])
        groups = range(first, first + counts[position])
        elementwise: dict[str, dict[str, torch.Tensor]] = {}
        for entry in plan_optimizer(known, groups):  # the same order on every rank
            numel = 1
            for s in entry.shape:
                numel *= s
            full = torch.zeros(numel, dtype=entry.dtype, device=state.device)
            piece = tensors.get(entry.name)
            if piece is not None:
                start = written[entry.source]["start"]
                values = piece.load()
                full[start : start + values.numel()] = values.to(full.device, entry.dtype)
            if rank0_only:  # the owners' ranges are disjoint: their sum is the whole
                world.reduce_sum(full, dst=0)
            else:
                world.all_reduce_sum(full)
            if keep:
                stored = entry.name.split("/", 1)[0]
                elementwise.setdefault(entry.source, {})[stored] = full.view(entry.shape).cpu()
        tensors.clear()
    finally:
        in_memory.close()
    if not keep:
        return {}
    return numbered(optimizer_states(index, elementwise)[position])


def numbered(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict keyed by parameter name, keyed by position instead, as torch's
    `Optimizer.state_dict()` numbers the parameters: group after group, a parameter
    listed twice keeping its first number."""
    ids: dict[str, int] = {}
    groups, start = [], 0
    for group in state_dict["param_groups"]:
        names = group["params"]
        for i, name in enumerate(names, start):
            ids.setdefault(name, i)
        groups.append({**group, "params": [ids[n] for n in names]})
        start += len(names)
    state = {ids[name]: value for name, value in state_dict["state"].items()}
    return {"state": state, "param_groups": groups}
