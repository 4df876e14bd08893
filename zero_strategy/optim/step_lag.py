"""Each parameter's own step count, where it falls behind its param group's.

One process keeps Adam's `step` per parameter: a parameter with no gradient on a step
(its `.grad` None) is skipped, count and all, and the bias correction of its later steps
uses its own, smaller count. The engine steps a rank's slice of a unit whole, many model
parameters at once, with one count; `held_back` puts back the values and moments of those
no rank gave a gradient, and here each one's lag behind its group's count is kept.

When a lagging parameter has a gradient again, its range is stepped twice: with the
slice (the group's count), then, put back as it was, alone with its own count. The second
step is the same optimizer's (its class, its param group's settings), over sub-parameters
that are views of the slice and of its state, with a count of their own: an elementwise
optimizer then computes what one process does, to the bit. It costs a second step over
the lagging ranges only, and none at all while no parameter lags.

Lags are kept per model parameter and param group, so that checkpoints record them by
name (`step_lags`) and a checkpoint can be cut again at another world size or stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .. import private_api
from ..units.optimizer_view import OptimizerView
from .held_back import slot_parts

# (param group, unit index, slot index): one model parameter as one group steps it.
SlotKey = tuple[int, int, int]
Ranges = Mapping[int, list[tuple[int, int]]]  # per view (by id): [start, end) within it
# A param group's optimizer and the group's dict in it.
GroupOwner = Callable[[int], tuple[torch.optim.Optimizer, dict[str, Any]]]

COUNT = "step"  # the state key of a per-parameter step count (every torch optimizer's)


def _count(state: Mapping[str, Any] | None) -> float:
    """The step count in one parameter's optimizer state (0 before its first step)."""
    value = (state or {}).get(COUNT, 0)
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _shaped(state: Mapping[str, Any], param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state tensors shaped as the parameter: its elementwise state."""
    return {
        k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == param.shape
    }


class StepLags:
    """How many of its group's steps each model parameter has missed (only those behind)."""

    def __init__(self) -> None:
        self.lags: dict[SlotKey, int] = {}

    def lagging(self, views: Sequence[OptimizerView]) -> bool:
        """Whether any of `views` holds a parameter behind its group's count (its step
        is then not the fused kernel's, which steps a view with one count)."""
        if not self.lags:
            return False
        return any(
            (v.group_index, v.unit.layout.index, slot) in self.lags
            for v in views
            for slot, _, _ in slot_parts(v)
        )

    @contextlib.contextmanager
    def kept(
        self,
        views: Sequence[OptimizerView],
        held: Ranges,
        state: Mapping,
        owner: GroupOwner,
    ) -> Iterator[None]:
        """Around a step of `views`, whose `held` ranges got no gradient: after it, the
        lagging ranges that did are stepped again with their own counts, and the held
        ranges of every view whose count advanced fall one step further behind."""
        if not self.lags and not any(held.get(id(v)) for v in views):
            yield
            return
        plans = []
        for view in views:
            held_here = set(held.get(id(view), ()))
            unit_index = view.unit.layout.index
            missed, behind = [], []
            for slot, lo, hi in slot_parts(view):
                key = (view.group_index, unit_index, slot)
                if (lo, hi) in held_here:
                    missed.append(key)
                elif key in self.lags:
                    behind.append((key, lo, hi))
            if not missed and not behind:
                continue
            own = state.get(view.param) or {}
            before = _count(own)
            tensors = [view.param.data, *_shaped(own, view.param).values()] if behind else []
            saved = [[t[lo:hi].clone() for t in tensors] for _, lo, hi in behind]
            plans.append((view, before, missed, behind, saved))
        yield
        again: dict[int, list[tuple[nn.Parameter, dict[str, Any]]]] = {}
        for view, before, missed, behind, saved in plans:
            own = state.get(view.param) or {}
            if COUNT not in own or _count(own) == before:
                continue  # not stepped here, or an optimizer with no count
            for key in missed:
                self.lags[key] = self.lags.get(key, 0) + 1
            if view.param.grad is None:
                continue
            shaped = _shaped(own, view.param)
            for (key, lo, hi), values in zip(behind, saved):
                for tensor, value in zip([view.param.data, *shaped.values()], values):
                    tensor[lo:hi].copy_(value)
                again.setdefault(view.group_index, []).append(
                    _sub_parameter(view, own, shaped, lo, hi, before - self.lags[key])
                )
        if again:
            _step_alone(again, owner)

    # ---------------------------------------------------------------- checkpoints
    def by_name(self, name_of: Callable[[int, int], str], groups: int) -> list[dict[str, int]]:
        """Per param group, {stored name: lag} of the parameters behind (`name_of` maps a
        (unit index, slot index) to the name a checkpoint stores it by)."""
        out: list[dict[str, int]] = [{} for _ in range(groups)]
        for (group, unit, slot), lag in sorted(self.lags.items()):
            out[group][name_of(unit, slot)] = lag
        return out

    def load(self, saved: Sequence[Mapping[str, int]], keys_of: Mapping[str, list]) -> None:
        """Lags from a checkpoint's `step_lags` (per group, by stored name); `keys_of`
        maps a stored name to the (unit index, slot index) of this rank's parameters."""
        self.lags = {}
        for group, lags in enumerate(saved):
            for name, lag in lags.items():
                for unit, slot in keys_of.get(name, ()):
                    if lag > 0:
                        self.lags[(group, unit, slot)] = int(lag)

    def clear(self) -> None:
        self.lags = {}


def _sub_parameter(
    view: OptimizerView,
    own: Mapping[str, Any],
    shaped: Mapping[str, torch.Tensor],
    lo: int,
    hi: int,
    count: float,
) -> tuple[nn.Parameter, dict[str, Any]]:
    """A parameter over [lo, hi) of the view (sharing its memory), its gradient's range,
    and a state of views of the view's, with `count` as its step count."""
    sub = nn.Parameter(view.param.data[lo:hi])
    sub.grad = view.param.grad[lo:hi]
    state = {k: v for k, v in own.items() if k not in shaped}
    state.update({k: v[lo:hi] for k, v in shaped.items()})
    kept = own[COUNT]
    if isinstance(kept, torch.Tensor):
        state[COUNT] = torch.tensor(count, dtype=kept.dtype, device=kept.device)
    else:
        state[COUNT] = type(kept)(count)
    return sub, state


def _step_alone(
    parts: Mapping[int, list[tuple[nn.Parameter, dict[str, Any]]]], owner: GroupOwner
) -> None:
    """One step of each owning optimizer over the sub-parameters of its groups alone: its
    param groups and state are swapped for theirs around the step (no hook runs), and any
    state tensor the step replaced rather than updated is copied back into the view."""
    by_optimizer: dict[int, tuple[torch.optim.Optimizer, list[dict[str, Any]]]] = {}
    for group_index, subs in parts.items():
        optimizer, group = owner(group_index)
        entry = by_optimizer.setdefault(id(optimizer), (optimizer, []))
        entry[1].append({**group, "params": [p for p, _ in subs]})
    states = {p: s for subs in parts.values() for p, s in subs}
    originals = {p: dict(s) for p, s in states.items()}
    for optimizer, groups in by_optimizer.values():
        kept_groups, kept_state = optimizer.param_groups, optimizer.state
        optimizer.param_groups = groups
        optimizer.state = type(kept_state)(dict)
        optimizer.state.update(states)
        try:
            private_api.step_without_hooks(optimizer)
        finally:
            optimizer.param_groups, optimizer.state = kept_groups, kept_state
    for param, state in states.items():
        for key, view in originals[param].items():
            now = state.get(key)
            if key != COUNT and isinstance(view, torch.Tensor) and now is not view:
                view.copy_(now)
