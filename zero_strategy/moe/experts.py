"""This rank's experts: copies of one expert module, each initialised from its global
expert id, so that the same seed gives the same experts at every expert-parallel size."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn


class Experts(nn.Module):
    """`num_local` copies of `expert`, holding global experts `first_id ...` (0 until the
    expert-parallel group is known: `assign`).

    Each copy's parameters are re-initialised (`init(submodule)` for every submodule, or
    `reset_parameters()` of every submodule that has one) under a seed derived from `seed` and the global id: expert 5 gets the
    same values whether this rank holds experts 4-7 or all of them.
    """

    def __init__(
        self,
        expert: nn.Module,
        num_local: int,
        seed: int,
        init: Callable[[nn.Module], None] | None = None,
    ):
        super().__init__()
        self.seed = seed
        self.init = init
        self.first_id = 0
        self.local = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local))
        self._initialise()

    def assign(self, first_id: int) -> None:
        """Hold global experts `first_id ...` (this rank's place in its expert-parallel
        group), initialised as those experts."""
        if first_id != self.first_id:
            self.first_id = first_id
            self._initialise()

    def keep(self, first_id: int, count: int) -> list[nn.Parameter]:
        """Keep experts `first_id .. first_id + count - 1` of the ones held (all of them,
        initialised by global id); returns the parameters of the others, now dropped."""
        kept = list(self.local[first_id - self.first_id : first_id - self.first_id + count])
        dropped = [p for m in self.local if all(m is not k for k in kept) for p in m.parameters()]
        self.local = nn.ModuleList(kept)
        self.first_id = first_id
        return dropped

    def zero_initialise(self) -> None:
        """Materialisation from the meta device calls this (not the model's own init), so
        that each expert still gets the values of its global id."""
        self._initialise()

    def _initialise(self) -> None:
        for i, module in enumerate(self.local):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed + self.first_id + i)
                for sub in module.modules():
                    if self.init is not None:
                        self.init(sub)
                    elif hasattr(sub, "reset_parameters"):
                        sub.reset_parameters()

    def forward(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """`chunks[i]` are the rows for local expert i (possibly none): the container runs
        them all, so that stage 3 gathers the experts once per pass, even on a rank whose
        experts receive no token."""
        out = []
        for module, rows in zip(self.local, chunks, strict=True):
            y = module(rows)
            if y.shape != rows.shape:
                raise ValueError(
                    f"An MoE expert must return its input's shape; {type(module).__name__} "
                    f"turned {tuple(rows.shape)} into {tuple(y.shape)}. Project back to the "
                    "hidden size inside the expert (e.g. Linear(h, 4h), act, Linear(4h, h))."
                )
            out.append(y)
        return out
