"""Models prepared without an optimizer, and trained anyway: averaged as DDP averages them.

Accelerate wraps a model prepared on its own in DistributedDataParallel when it has
trainable parameters: its parameters start as rank 0's, each backward leaves every rank
the mean gradient, and `no_sync()` keeps it local. `ZeroAccelerator` cannot wrap it, since
an optimizer prepared later shards that same module in place. It keeps the module as it
is and does what DDP would: rank 0's parameters and buffers at prepare, and the gradients
averaged after each backward that is not under `no_sync()` (one collective per dtype).
As in the engine, the backward decides, not the forward: `trigger_sync_in_backward` is
honoured, and a backward outside `no_sync()` synchronises whatever the forward did; the
sums are linear, so the gradients DDP shows after its synchronising backward are the same.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def _in_place(tensors: list[torch.Tensor], collective) -> None:
    """Run `collective` on one flat copy per (dtype, device) of `tensors`, then copy back."""
    by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        by_kind[(t.dtype, t.device)].append(t)
    for group in by_kind.values():
        flat = _flatten_dense_tensors(group)
        collective(flat)
        for t, value in zip(group, _unflatten_dense_tensors(flat, group)):
            t.copy_(value)


def average_gradients(params: list[torch.Tensor]) -> None:
    """Every rank's `.grad` of `params` becomes the mean over the ranks. A parameter with
    no gradient here but one elsewhere takes part with zeros (as DDP's unused parameters
    do), so that every rank issues the same collectives."""
    if not params:
        return
    held = torch.tensor(
        [p.grad is not None for p in params], dtype=torch.int32, device=params[0].device
    )
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    chosen = [p for p, flag in zip(params, held.tolist()) if flag]
    for p in chosen:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    world = dist.get_world_size()

    def mean(flat: torch.Tensor) -> None:
        dist.all_reduce(flat)
        flat.div_(world)

    _in_place([p.grad for p in chosen], mean)


class ReplicatedModels:
    """The trainable models an accelerator prepared without an optimizer."""

    def __init__(self) -> None:
        self._models: list[nn.Module] = []
        self._local: set[int] = set()  # id() of the models under no_sync()

    def add(self, model: nn.Module) -> None:
        """Start replicating `model` (collective: rank 0's parameters and buffers)."""
        if not _trainable(model) or model in self:
            return
        if _distributed():
            state = [t.data for t in (*model.parameters(), *model.buffers())]
            _in_place(state, lambda flat: dist.broadcast(flat, src=0))
        self._models.append(model)

    def remove(self, model: nn.Module) -> None:
        """`model` now has an engine of its own (its optimizer was prepared)."""
        self._models = [m for m in self._models if m is not model]
        self._local.discard(id(model))

    def __contains__(self, model: nn.Module) -> bool:
        return any(m is model for m in self._models)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self._local_while(model, True)

    def synchronised(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """`trigger_sync_in_backward`: the backward inside synchronises, even under
        `no_sync()`."""
        return self._local_while(model, False)

    @contextlib.contextmanager
    def _local_while(self, model: nn.Module, local: bool) -> Iterator[None]:
        was = id(model) in self._local
        (self._local.add if local else self._local.discard)(id(model))
        try:
            yield
        finally:
            (self._local.add if was else self._local.discard)(id(model))

    def after_backward(self) -> None:
        """Average the gradients of every model not under `no_sync()`; every rank calls
        this after each backward, as DDP's reducer runs in each."""
        if not _distributed():
            return
        for model in self._models:
            if id(model) not in self._local:
                average_gradients(_trainable(model))
