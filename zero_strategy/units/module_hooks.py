"""Module hooks that belong to the engine, not to the module.

`copy.deepcopy(model)` (an EMA or averaged copy, Lightning's weight-averaging callbacks)
copies a module's hook dictionaries, and each hook with them. The engine's hooks drive
its gathers, buffer broadcasts and state-dict views of *this* model; in a copy they would
run the original's collectives, or copy the engine itself. Wrapped here, a hook becomes
a no-op in any deep copy, so the copy is a plain module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _inert(*args: Any, **kwargs: Any) -> None:
    return None


class EngineHook:
    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return _inert
