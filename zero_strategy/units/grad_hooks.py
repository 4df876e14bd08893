"""The post-accumulate-grad hooks through which the reducer hears of each gradient.

A module conversion (`.to()`) swaps a DTensor parameter's contents, which unwires its
hooks: they stay listed on it but no longer run. So a DTensor parameter's hook is kept
beside the local shard it had when hooked, and wired again (with any other hooks listed
on it) once the shard has changed (`rehook_converted`, before each forward).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

from torch import nn

from ..private_api import clear_post_accumulate_grad_hooks, post_accumulate_grad_hooks
from ..tensor_parallel import is_dtensor, local_tensor

# Told of a parameter's gradient: (unit position, slot index, the parameter).
OnGrad = Callable[[int, int, nn.Parameter], None]


class GradHooks:
    """One hook per trainable parameter of `units` (each as (slots, params)), calling
    `on_grad` (a bound method, held weakly: autograd's hooks on a tensor are invisible to
    the garbage collector, so a strong reference from there would keep the engine, and
    its process groups, alive after the user dropped the model)."""

    def __init__(self, units: Sequence[tuple[Sequence, Sequence[nn.Parameter]]], on_grad: OnGrad):
        self._on_grad = weakref.WeakMethod(on_grad)
        self.handles: list = []
        # DTensor parameters: (parameter, position, slot, index in handles, its shard then)
        self._dtensors: list[tuple[nn.Parameter, int, int, int, weakref.ref]] = []
        for position, (slots, params) in enumerate(units):
            for slot_index, (slot, p) in enumerate(zip(slots, params)):
                if slot.trainable:
                    self.handles.append(self._hook(p, position, slot_index))
                    if is_dtensor(p):
                        entry = (p, position, slot_index, len(self.handles) - 1)
                        self._dtensors.append((*entry, weakref.ref(local_tensor(p))))

    def _hook(self, p: nn.Parameter, position: int, slot_index: int):
        on_grad = self._on_grad

        def hook(p: nn.Parameter) -> None:
            method = on_grad()
            if method is not None:
                method(position, slot_index, p)

        return p.register_post_accumulate_grad_hook(hook)

    def rehook_converted(self) -> None:
        """A DTensor parameter swapped since it was hooked has its post-accumulate hooks
        wired again (ours, and any others listed on it)."""
        for i, (p, position, slot_index, at, local) in enumerate(self._dtensors):
            if local() is local_tensor(p):
                continue
            listed = post_accumulate_grad_hooks(p)
            listed.pop(self.handles[at].id, None)
            clear_post_accumulate_grad_hooks(p)  # registering again wires a new list
            self.handles[at] = self._hook(p, position, slot_index)
            for hook in listed.values():
                p.register_post_accumulate_grad_hook(hook)
            self._dtensors[i] = (p, position, slot_index, at, weakref.ref(local_tensor(p)))
