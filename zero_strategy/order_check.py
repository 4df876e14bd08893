"""Stage 3's divergence check: every rank gathers the same unit at the same point.

Ranks that take different module paths would pair mismatched gathers and hang (or, on
gloo, abort on mismatched sizes). So before each gather, every rank's (unit, phase) tag
is exchanged over the data-parallel ranks, and any disagreement raises on every rank,
naming each rank's module.

The tags travel on a gloo group of their own: they only ever pair with each other, never
queue behind gradient reductions in flight on the engine's groups, and are CPU integers
(no device sync under NCCL).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .comm import Communicator

FORWARD, BACKWARD, STATE_DICT = 0, 1, 2
_PHASE_NAMES = {FORWARD: "forward", BACKWARD: "backward", STATE_DICT: "state_dict"}


class ModulePathDivergenceError(RuntimeError):
    """Ranks disagreed on which module to gather next (stage 3)."""


class OrderCheck:
    def __init__(self, comm: Communicator, unit_name: Callable[[int], str | None]):
        self.comm = comm
        self.unit_name = unit_name  # a unit's module name, None for an unknown index
        self._exchanges = 0  # of this process, for the error message

    def check(self, index: int, phase: int) -> None:
        """Just before gathering unit `index`: raise if any rank is about to gather
        another one."""
        self._exchanges += 1
        tag = torch.tensor([index, phase], dtype=torch.int64)
        tags = self.comm.control_all_gather(tag).tolist()
        if any(t != tags[0] for t in tags):
            raise self._divergence(tags)

    def _divergence(self, tags: list[list[int]]) -> ModulePathDivergenceError:
        lines = [
            f"  rank {rank}: {_PHASE_NAMES.get(phase, '?')} of {self._module(index)}"
            for rank, (index, phase) in enumerate(tags)
        ]
        hint = (
            "\nstate_dict() and load_state_dict() gather a stage-3 model, so every rank must "
            "call them (not only rank 0); to write the model from rank 0 alone, use "
            "engine.full_state_dict() on every rank, or save a checkpoint and consolidate it."
            if any(phase == STATE_DICT for _, phase in tags)
            else ""
        )
        return ModulePathDivergenceError(
            "ZeRO stage 3: ranks took different module paths and would deadlock on the "
            f"parameter gather (order check #{self._exchanges} of this process):\n"
            + "\n".join(lines)
            + "\nEvery rank must call the same wrapped modules in the same order. Make the "
            "control flow identical on all ranks (e.g. run every branch, or decide the branch "
            "on rank 0 and broadcast it), or put the divergent modules inside one unit "
            "(ZeroConfig.unit_module_classes) so they are gathered together." + hint
        )

    def _module(self, index: int) -> str:
        name = self.unit_name(index)
        return f"module '{name}'" if name is not None else f"unknown unit {index}"
