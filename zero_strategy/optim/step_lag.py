"""Each parameter's own step count, where it falls behind its param group's.

One process keeps Adam's `step` per parameter: a parameter with no gradient on a step
(its `.grad` None) is skipped, count and all, and the bias correction of its later steps
uses its own, smaller count. The engine's optimizer parameters are a rank's slices of
units, many model parameters each, with one count. So each model parameter's lag behind
its slice's count is kept here, and a slice that holds a parameter with no gradient on
this step, or one that lags, is not stepped whole: its model parameters are stepped as
sub-parameters (views of the slice, of its gradient and of its state), by the same
optimizer with its param group's settings, in one step: each with its own count, the
runs between them with the slice's, and those with no gradient not at all. The slice's
count then advances by one. An elementwise optimizer so computes what one process does,
to the bit, at the cost of a step over a few more, shorter tensors; slices with neither
step whole, as before.

A slice whose state does not exist yet (its first step) is stepped whole, and its
parameters with no gradient are put back after it (`held_back`): the optimizer makes the
state, whatever its kind.

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
from ..units.optimizer_view import OptimizerView, slot_parts

# (param group, unit index, slot index): one model parameter as one group steps it.
SlotKey = tuple[int, int, int]
# Per view (by id): the [start, end) ranges within it that got no gradient.
HeldRanges = Mapping[int, list[tuple[int, int]]]
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


def counts_alone(state: Mapping[str, Any] | None, param: torch.Tensor) -> bool:
    """Whether a parameter's state is elementwise tensors and a step count, nothing else:
    Adam's, AdamW's, RAdam's, Adamax's, Adagrad's... Another scalar that changes with
    each step (NAdam's `mu_product`, ASGD's `eta`) would be the slice's, not each
    parameter's: such an optimizer is stepped by slices, with no lags kept."""
    if not state or COUNT not in state:
        return False
    shaped = _shaped(state, param)
    return all(key == COUNT or key in shaped for key in state)


class StepLags:
    """How many of its group's steps each model parameter has missed (only those behind)."""

    def __init__(self) -> None:
        self.lags: dict[SlotKey, int] = {}

    def plan(
        self, views: Sequence[OptimizerView], held: HeldRanges, state: Mapping, stepped: set[int]
    ) -> StepPlan:
        """How a step treats `views`, whose `held` ranges got no gradient, the views of
        the param groups in `stepped` being stepped: which are stepped by parts."""
        plan = StepPlan(self, held)
        if not self.lags and not any(held.get(id(v)) for v in views):
            return plan
        for view in views:
            if view.group_index not in stepped:
                continue
            held_here = set(held.get(id(view), ()))
            unit_index = view.unit.layout.index
            parts = []
            for slot, lo, hi in slot_parts(view):
                key = (view.group_index, unit_index, slot)
                if (lo, hi) in held_here:
                    parts.append((key, lo, hi, None))
                else:
                    parts.append((key, lo, hi, self.lags.get(key, 0)))
            if all(lag == 0 for *_, lag in parts):
                continue
            own = state.get(view.param)
            if own is None:  # its first step makes its state: whole, the held put back
                plan.whole.append((view, [k for k, *_, lag in parts if lag is None]))
                continue
            behind = max((lag for *_, lag in parts if lag), default=0)
            if behind > (count := _count(own)):  # the lags loaded do not fit the state
                raise RuntimeError(
                    f"A parameter's step count would be negative: it is {behind} steps "
                    f"behind a count of {count:g}. The lags loaded with the optimizer's "
                    "state do not fit it; load a checkpoint the engine saved."
                )
            if counts_alone(own, view.param):
                plan.by_parts.append((view, parts))
        return plan

    def fell_behind(self, keys: Sequence[SlotKey]) -> None:
        for key in keys:
            self.lags[key] = self.lags.get(key, 0) + 1

    def of_groups(self, groups: set[int]) -> dict[SlotKey, int]:
        """The lags of `groups`' parameters (one optimizer's)."""
        return {key: lag for key, lag in self.lags.items() if key[0] in groups}

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

    def replace(self, groups: set[int], lags: Mapping[SlotKey, int]) -> None:
        """The lags of `groups`' parameters are `lags` (an optimizer's state loaded)."""
        self.lags = {k: v for k, v in self.lags.items() if k[0] not in groups}
        self.lags.update({k: v for k, v in lags.items() if k[0] in groups and v > 0})


class StepPlan:
    """One step's treatment of the views with a parameter that has no gradient or lags:
    `by_parts` (with their parts: key, range, lag, or None for no gradient) are kept out
    of the optimizer's own step and stepped by `finish`; `whole` (no state yet) are
    stepped whole, their `held` ranges put back (`held_back`)."""

    def __init__(self, lags: StepLags, held: HeldRanges) -> None:
        self._lags = lags
        self._held = held
        self.by_parts: list[tuple[OptimizerView, list[tuple[SlotKey, int, int, int | None]]]] = []
        self.whole: list[tuple[OptimizerView, list[SlotKey]]] = []

    @property
    def apart(self) -> set[int]:
        """The views (by id) the optimizer's own step must skip (their `.grad` hidden)."""
        return {id(view) for view, _ in self.by_parts}

    def held_for_whole_steps(self) -> HeldRanges:
        """The ranges to put back after the optimizer's own step: those of the views it
        steps (the views stepped by parts skip theirs)."""
        apart = self.apart
        return {k: v for k, v in self._held.items() if k not in apart}

    @contextlib.contextmanager
    def missed_by_first_steps(self, state: Mapping) -> Iterator[None]:
        """Around the optimizer's own step: a view stepped whole for the first time
        leaves its parameters with no gradient one step behind, if the state it made
        counts steps per parameter (`counts_alone`)."""
        yield
        for view, missed in self.whole:
            if counts_alone(state.get(view.param), view.param):
                self._lags.fell_behind(missed)

    def finish(self, state: Mapping, owner: GroupOwner) -> None:
        """Step the views kept apart, by parts, in one step of each optimizer; their
        counts advance by one, and their parameters with no gradient fall behind."""
        subs: dict[int, list[tuple[nn.Parameter, dict[str, Any]]]] = {}
        counts = []
        for view, parts in self.by_parts:
            own = state.get(view.param)
            count = _count(own)
            shaped = _shaped(own, view.param)
            for lo, hi, lag in _runs(parts):
                subs.setdefault(view.group_index, []).append(
                    _sub_parameter(view, own, shaped, lo, hi, count - lag)
                )
            self._lags.fell_behind([key for key, *_, lag in parts if lag is None])
            counts.append(own)
        if subs:
            _step_alone(subs, owner)
        for own in counts:  # the slice's count, as its own step would have advanced it
            if isinstance(own[COUNT], torch.Tensor):
                own[COUNT].add_(1)
            else:
                own[COUNT] += 1


def _runs(parts: list[tuple[SlotKey, int, int, int | None]]) -> list[tuple[int, int, int]]:
    """The ranges of a view to step, with their lags: the parts with a gradient, each run
    of neighbours with one lag merged (the padding between them steps with them, as in a
    whole step)."""
    runs: list[tuple[int, int, int]] = []
    joinable = False  # the last part had a gradient
    for _, lo, hi, lag in sorted(parts, key=lambda part: part[1]):
        if lag is not None and joinable and runs[-1][2] == lag:
            runs[-1] = (runs[-1][0], hi, lag)
        elif lag is not None:
            runs.append((lo, hi, lag))
        joinable = lag is not None
    return runs


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
    sub.grad = view.grad[lo:hi]
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
