"""Several optimizers over disjoint parameter sets, seen as one by the engine's layout
and checkpoints (a GAN's generator and discriminator optimizers, manual optimization
with two optimizers).

Each optimizer stays the user's object and steps on its own; `OptimizerSet` only
presents their param groups as one list (the same dicts, so re-pointing a group writes
through to its optimizer) and their states as one mapping routed by parameter, so that
the layout, the re-pointing and the sharded checkpoint treat "group i" alike whether it
belongs to the first optimizer or the second.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import torch


class _RoutedState(MutableMapping):
    """`optimizer.state` of every optimizer at once: a key lands in the state of the
    optimizer whose param groups hold it."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self.optimizers = optimizers

    def _owner(self, param: torch.Tensor) -> torch.optim.Optimizer:
        for opt in self.optimizers:
            if any(p is param for group in opt.param_groups for p in group["params"]):
                return opt
        raise KeyError("the tensor is in no optimizer of the set")

    def __getitem__(self, param):
        return self._owner(param).state[param]

    def __setitem__(self, param, value) -> None:
        self._owner(param).state[param] = value

    def __delitem__(self, param) -> None:
        del self._owner(param).state[param]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for opt in self.optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self.optimizers)

    def get(self, param, default=None):
        for opt in self.optimizers:
            if param in opt.state:
                return opt.state[param]
        return default

    def clear(self) -> None:
        for opt in self.optimizers:
            opt.state.clear()


class OptimizerSet:
    """The optimizers of one engine, in order; `group_offsets[k]` is the index of
    optimizer k's first group in the combined `param_groups`."""

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        facing: Sequence[torch.optim.Optimizer] | None = None,
    ):
        self.optimizers = list(optimizers)
        # The user's objects, one per optimizer: each is the optimizer, but a torch
        # ZeroRedundancyOptimizer, which the optimizer it wraps steps for
        # (`zero_redundancy.py`); the frameworks hold and name these.
        self.facing = list(facing) if facing is not None else list(optimizers)
        self.group_offsets: list[int] = []
        total = 0
        for opt in self.optimizers:
            self.group_offsets.append(total)
            total += len(opt.param_groups)
        self.state: MutableMapping[Any, Any] = _RoutedState(self.optimizers)
        # Each group's parameters as the user built it, in order (the engine then points
        # the groups at its own views): a one-file checkpoint lists them so.
        self.built_with: list[list[torch.Tensor]] = [list(g["params"]) for g in self.param_groups]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def name(self) -> str:
        """What checkpoints record: "AdamW", or "Adam+SGD" for several."""
        return "+".join(type(opt).__name__ for opt in self.optimizers)

    def index_of(self, optimizer: torch.optim.Optimizer) -> int:
        for k, (opt, facing) in enumerate(zip(self.optimizers, self.facing)):
            if optimizer is opt or optimizer is facing:
                return k
        raise ValueError(
            f"This {type(optimizer).__name__} is not one of the engine's optimizers; step "
            "the optimizers given to ZeroEngine (or returned by configure_optimizers)."
        )

    def position_of(self, optimizer: Any) -> int:
        """Which optimizer `optimizer` is (a framework's wrapper of one too: its
        `.optimizer`); None names the only one."""
        if len(self.optimizers) == 1:
            return 0
        if optimizer is None:
            raise ValueError(
                f"The engine has {len(self.optimizers)} optimizers: name the one whose state "
                "you want, full_optimizer_state_dict(optimizer)."
            )
        return self.index_of(getattr(optimizer, "optimizer", optimizer))

    def wrapper_of(self, k: int) -> torch.optim.Optimizer | None:
        """The ZeroRedundancyOptimizer optimizer k steps for, or None (it is the user's)."""
        facing = self.facing[k]
        return None if facing is self.optimizers[k] else facing

    def groups_of(self, k: int) -> range:
        """Combined group indices of optimizer k."""
        return range(
            self.group_offsets[k], self.group_offsets[k] + len(self.optimizers[k].param_groups)
        )

    def _optimizer_of_group(self, gi: int) -> int:
        return max(i for i, offset in enumerate(self.group_offsets) if offset <= gi)

    def owner_of(self, gi: int) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
        """Combined group `gi`'s optimizer, and the group's dict in it."""
        k = self._optimizer_of_group(gi)
        return self.optimizers[k], self.optimizers[k].param_groups[gi - self.group_offsets[k]]

    def describe_group(self, gi: int) -> str:
        """Combined group `gi` in the user's terms: "param group 1", or with several
        optimizers "optimizer 1 (Adam) param group 0"."""
        if len(self.optimizers) == 1:
            return f"param group {gi}"
        k = self._optimizer_of_group(gi)
        name = type(self.optimizers[k]).__name__
        return f"optimizer {k} ({name}) param group {gi - self.group_offsets[k]}"
