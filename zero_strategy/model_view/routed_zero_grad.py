"""`model.zero_grad()` and `optimizer.zero_grad()` routed to the engine.

At stages 2-3 the parameters hold no `.grad` for those calls to clear, so the engine
puts its own `zero_grad` on both objects. A deep copy of the model (an EMA copy, an
averaged model) is a plain module: its copy of the attribute is the class's own
`zero_grad`, bound to the copy, and never reaches the engine (or tries to copy it).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any


class RoutedZeroGrad:
    def __init__(self, owner: object, target: Callable[..., None]):
        self._owner_id = id(owner)
        self._target = target

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return self._target(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        copy = memo.get(self._owner_id)  # the owner's copy, made before its attributes
        if copy is None:
            return self
        return types.MethodType(type(copy).zero_grad, copy)


def route_zero_grad(owner: object, target: Callable[..., None]) -> None:
    """`owner.zero_grad(...)` calls `target(...)` from now on."""
    owner.zero_grad = RoutedZeroGrad(owner, target)
