"""`optimizer.state_dict()` / `optimizer.load_state_dict()` on an optimizer the engine
shards.

torch's own methods still run on it: the state dict holds this rank's flat shards (one
1-D tensor per unit and param group), which load back only into the same rank of the
same layout. A DDP user's `if rank == 0: torch.save(optimizer.state_dict())` saves rank
0's shards, and the resume would load them into every rank without a word. So each
state dict the optimizer hands out carries a mark (the rank, the world size, the stage
and the shard ranges it covers), and a load whose mark differs, or that has none (a
whole state dict, as DDP's optimizer gives), is refused, naming what loads at any world
size: the engine's checkpoints. Both through torch's public optimizer hooks.

The mark also carries how far each of the rank's parameters is behind its group's step
count (`step_lag`), which the flat shards' one count per slice cannot say: a load puts
the lags back with the state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..units.optimizer_view import OptimizerView
from .step_lag import StepLags

MARK = "zero_strategy_shards"
LAGS = "step_lags"  # in the mark: [param group, unit, slot, lag] of each lagging parameter


def guard_state_dicts(
    optimizer: torch.optim.Optimizer,
    views: Sequence[OptimizerView],
    stage: int,
    step_lags: StepLags,
) -> list[Any]:
    """Mark `optimizer`'s state dicts and check the mark on load; returns the handles."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    ranges = [
        [v.unit.layout.index, v.unit.opt_start + v.lo, v.unit.opt_start + v.hi]
        for v in views
        if id(v.param) in held
    ]
    mark = {"rank": rank, "world_size": world, "stage": stage, "ranges": ranges}
    groups = {v.group_index for v in views if id(v.param) in held}
    loaded_lags: list[list[int]] = []  # between the load's pre-hook and its post-hook

    def add_mark(_optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        lags = [[*key, lag] for key, lag in sorted(step_lags.of_groups(groups).items())]
        state_dict[MARK] = {**mark, "ranges": [list(r) for r in ranges], LAGS: lags}

    def check_mark(_optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        found = state_dict.get(MARK)
        if found is None:
            raise ValueError(
                "optimizer.load_state_dict() got a state dict without zero-strategy's mark "
                "(a whole one, as a DDP or single-process optimizer gives): this optimizer "
                "holds only this rank's flat shards of the state. Resume with "
                "engine.load_checkpoint() of a checkpoint the engine saved, or of one file "
                "torch.save({'state_dict': model_state, 'optimizer_states': [that state "
                "dict]}), which loads a whole state into the shards at any world size and "
                "stage."
            )
        found = dict(found)
        lags = found.pop(LAGS, [])  # (a state dict saved before lags were kept: none)
        if not _lags_fit(lags, groups):
            raise ValueError(
                f"optimizer.load_state_dict() got a mark whose {LAGS!r} is not a list of "
                "[param group, unit, slot, lag] of this optimizer's groups: the state dict "
                "was changed since this engine saved it. Save it again, or resume with "
                "engine.load_checkpoint()."
            )
        if found != mark:
            raise ValueError(
                f"optimizer.load_state_dict() got the shards rank {found['rank']} of "
                f"{found['world_size']} saved at stage {found['stage']}; this is rank "
                f"{rank} of {world} at stage {stage}, and each rank's state dict holds "
                "only its own shards (other ranges). Save and resume with "
                "engine.save_checkpoint()/load_checkpoint() (any world size and stage), "
                "or have every rank save and load its own state dict."
            )
        loaded_lags[:] = [list(entry) for entry in lags]
        return {k: v for k, v in state_dict.items() if k != MARK}

    def put_lags(_optimizer: torch.optim.Optimizer) -> None:
        """The load took the state: the lags saved with it replace this optimizer's."""
        step_lags.replace(groups, {(g, u, s): lag for g, u, s, lag in loaded_lags})
        loaded_lags.clear()

    return [
        optimizer.register_state_dict_post_hook(add_mark),
        optimizer.register_load_state_dict_pre_hook(check_mark),
        optimizer.register_load_state_dict_post_hook(put_lags),
    ]


def _lags_fit(lags: Any, groups: set[int]) -> bool:
    """Whether a mark's lags are [param group, unit, slot, lag] entries of `groups`."""
    if not isinstance(lags, list):
        return False
    for entry in lags:
        if not isinstance(entry, (list, tuple)) or len(entry) != 4:
            return False
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in entry):
            return False
        if entry[0] not in groups:
            return False
    return True
