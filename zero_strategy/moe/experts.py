"""This rank's experts: copies of one expert module, or one batched module holding them
all (`batched.py`), each expert initialised from its global expert id, so that the same
seed gives the same experts at every expert-parallel size."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..layout.partition import Stored


def batched_rows(name: str, shape: tuple[int, ...], num_experts: int, ep_rank: int) -> Stored:
    """Where expert-parallel rank `ep_rank`'s batched weight `name` ([num_local, ...], all
    ranks holding as many) is stored: its rows of one [num_experts, ...] tensor under the
    same name, so checkpoints hold every expert by global id in one tensor."""
    return Stored(name, (num_experts, *shape[1:]), ep_rank * math.prod(shape))


class Experts(nn.Module):
    """`num_local` experts made from `expert`, holding global experts `first_id ...` (0
    until the expert-parallel group is known: `assign`): copies of it, or for a batched
    expert module (`batched = True`) one module of `num_local` experts.

    Each expert is (re-)initialised under a seed derived from `seed` and its global id
    (copies: `init(submodule)` for every submodule, or `reset_parameters()` of those that
    have one; batched: `reset_expert(i)`), so expert 5 gets the same values whether this
    rank holds experts 4-7 or all of them.
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
        self.batched = bool(getattr(expert, "batched", False))
        self.local: nn.Module = (
            expert.with_count(num_local)
            if self.batched
            else nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local))
        )
        self._initialise()

    @property
    def count(self) -> int:
        return next(self.local.parameters()).shape[0] if self.batched else len(self.local)

    def assign(self, first_id: int) -> None:
        """Hold global experts `first_id ...` (this rank's place in its expert-parallel
        group), initialised as those experts."""
        if first_id != self.first_id:
            self.first_id = first_id
            self._initialise()

    def keep(self, first_id: int, count: int) -> dict[int, nn.Parameter | None]:
        """Keep experts `first_id .. first_id + count - 1` of the ones held (all of them,
        initialised by global id). Returns, by id of each parameter no longer in the
        module, its replacement (a batched module's slice) or None (a dropped copy)."""
        start = first_id - self.first_id
        self.first_id = first_id
        if self.batched:
            old = dict(self.local.named_parameters())
            self.local = self.local.with_count(count)
            replaced = {}
            for name, param in self.local.named_parameters():
                if not param.is_meta:
                    with torch.no_grad():
                        param.copy_(old[name][start : start + count])
                param.requires_grad_(old[name].requires_grad)
                replaced[id(old[name])] = param
            return replaced
        kept = list(self.local[start : start + count])
        dropped = {
            id(p): None for m in self.local if all(m is not k for k in kept) for p in m.parameters()
        }
        self.local = nn.ModuleList(kept)
        return dropped

    def zero_initialise(self) -> None:
        """Materialisation from the meta device calls this (not the model's own init), so
        that each expert still gets the values of its global id."""
        self._initialise()

    def _initialise(self) -> None:
        for i in range(self.count):
            with _seeded(self.seed + self.first_id + i):
                if self.batched:
                    self.local.reset_expert(i)
                    continue
                for sub in self.local[i].modules():
                    if self.init is not None:
                        self.init(sub)
                    elif hasattr(sub, "reset_parameters"):
                        sub.reset_parameters()

    def forward(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """`chunks[i]` are the rows for local expert i (possibly none): the container runs
        them all, so that stage 3 gathers the experts once per pass, even on a rank whose
        experts receive no token."""
        if self.batched:
            out = list(self.local(chunks))
        else:
            out = [module(rows) for module, rows in zip(self.local, chunks, strict=True)]
        for rows, y in zip(chunks, out, strict=True):
            if y.shape != rows.shape:
                raise ValueError(
                    f"An MoE expert must return its input's shape; "
                    f"{type(self.local).__name__ if self.batched else 'the expert'} turned "
                    f"{tuple(rows.shape)} into {tuple(y.shape)}. Project back to the hidden "
                    "size inside the expert (e.g. Linear(h, 4h), act, Linear(4h, h))."
                )
        return out


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """The CPU generator (and the current CUDA device's, if CUDA is in use) seeded within,
    the caller's states restored after: other devices' streams are left alone."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = [torch.cuda.current_device()] if cuda else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)
        yield
