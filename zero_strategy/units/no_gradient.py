"""Which parameters no rank gave a gradient to, carried by the reduction itself.

One process leaves such a parameter's `.grad` at None and its optimizer skips it (no
momentum, no weight decay, no step count); DDP with `find_unused_parameters=True` does the
same for a parameter unused on every rank, at the cost of an all-reduce of a bitmap each
step. Here the reduction itself carries it: every gradient buffer starts filled with
negative zero, and a rank with no gradient for a parameter sends negative zeros. IEEE
addition keeps -0 only when every term is -0 (-0 + x = x for every x, +0 included;
scaling by a positive factor keeps the sign), so after the reduction an element is -0
exactly when no rank gave it a gradient, and a parameter whose part here is -0 in every
element is one that no rank used. The optimizer puts it back after the step
(`optim/held_back`): no collective is added for that. Only `.grad` at stages 2-3 needs
more (`given_anywhere`): a rank holds just its part of each parameter, so the ranks of a
shard group exchange one flag per parameter to agree which `.grad` reads None.

The limit: a parameter that was used, and whose gradient is exactly -0 in every element
of this rank's part, counts as unused (it would have taken a step with a zero gradient).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..comm.communicator import Communicator

NO_GRADIENT = -0.0


def fill_no_gradient(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (a gradient buffer) set to 'no gradient yet': negative zeros."""
    return tensor.fill_(NO_GRADIENT)


def no_gradient(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What a rank with no gradient for a parameter sends in its place."""
    return torch.full((numel,), NO_GRADIENT, dtype=dtype, device=device)


def _all_no_gradient(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.eq(0) & tensor.signbit()).all()


def got_no_gradient(grads: Sequence[torch.Tensor | None]) -> list[bool]:
    """For each reduced gradient: whether no rank gave it one (every element -0). One
    read of every first element per device (one host sync); a full pass only over those
    that start with -0 (a real gradient almost never does)."""
    flags = [False] * len(grads)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        if g is not None and g.numel():
            groups.setdefault((g.device, g.dtype), []).append(i)
    for members in groups.values():
        firsts = torch.cat([grads[i].reshape(-1)[:1] for i in members])
        starts = (firsts.eq(0) & firsts.signbit()).cpu().tolist()
        for i, start in zip(members, starts):
            flags[i] = start and bool(_all_no_gradient(grads[i]))
    return flags


def given_anywhere(
    parts: Sequence[tuple[Communicator, torch.device, torch.Tensor]],
) -> list[bool]:
    """For each parameter, as (its shard group's communicator, the device that group
    communicates on, this rank's part of its reduced gradient, possibly empty): whether any rank of the group gave it a gradient,
    the same answer on every rank of the group. The host syncs of `got_no_gradient` and
    one small control all-reduce per group, in the order the groups first appear: every
    rank of a group passes that group's parameters in the same order."""
    none_here = got_no_gradient([part for _, _, part in parts])
    seen_here = [part.numel() > 0 and not none for (*_, part), none in zip(parts, none_here)]
    members: dict[int, list[int]] = {}
    comms: dict[int, Communicator] = {}
    for i, (comm, _, _) in enumerate(parts):
        members.setdefault(id(comm), []).append(i)
        comms[id(comm)] = comm
    given = list(seen_here)
    for key, indices in members.items():
        comm = comms[key]
        if comm.size == 1:
            continue
        counts = torch.tensor([float(seen_here[i]) for i in indices], device=parts[indices[0]][1])
        comm.control_all_reduce(counts)
        for i, count in zip(indices, counts.cpu().tolist()):
            given[i] = count > 0
    return given
