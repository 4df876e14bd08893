"""Parameters that no rank gave a gradient to take no step, as in one process.

One process leaves such a parameter's `.grad` at None and its optimizer skips it: no
weight decay, no momentum coasting. The reduction marks them (`units/no_gradient`); here
the optimizer side honours the mark. An optimizer parameter is a rank's slice of a unit
(at stages 0-2 a bucket of many model parameters). Here the marked parameters are found;
a slice holding one is stepped by parts without it (`step_lag`), except on its first
step, which makes its state: it is stepped whole, and the elements of the marked
parameters in it, and in its optimizer state (the tensors shaped as it), are put back as
they were after the step (`held_back`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch

from ..units.no_gradient import got_no_gradient
from ..units.optimizer_view import OptimizerView, slot_parts

Ranges = list[tuple[int, int]]  # [start, end) within one view


def no_gradient_parts(views: Sequence[OptimizerView], resident: bool = False) -> dict[int, Ranges]:
    """For each view (by id) with any: the ranges that got no gradient on any rank (one
    per model parameter). Views whose gradients are offloaded count as having them,
    unless `resident` (their shards are in memory now: a step's tile)."""
    parts = [
        (view, lo, hi)
        for view in views
        if view.grad is not None and (view.unit.grad_home is None or resident)
        for _, lo, hi in slot_parts(view)
    ]
    marked = got_no_gradient([v.unit.grad_opt[v.lo + lo : v.lo + hi] for v, lo, hi in parts])
    ranges: dict[int, Ranges] = {}
    for (view, lo, hi), none in zip(parts, marked):
        if none:
            ranges.setdefault(id(view), []).append((lo, hi))
    return ranges


@contextlib.contextmanager
def held_back(
    views: Sequence[OptimizerView], ranges: Mapping[int, Ranges], state: Mapping
) -> Iterator[None]:
    """Around a step of `views`: the `ranges` of each (and of its optimizer state in
    `state`, keyed by the view's parameter) are as before it, after it."""
    saved = []
    for view in views:
        for lo, hi in ranges.get(id(view), ()):
            kept = state.get(view.param) or {}
            tensors = [view.param.data] + [
                t
                for t in kept.values()
                if isinstance(t, torch.Tensor) and t.shape == view.param.shape
            ]
            saved += [(t, lo, hi, t[lo:hi].clone()) for t in tensors]
    yield
    for tensor, lo, hi, values in saved:
        tensor[lo:hi].copy_(values)
