"""Module hooks that belong to the engine, not to the module.

`copy.deepcopy(model)` (an EMA or averaged copy, Lightning's weight-averaging callbacks)
copies a module's hook dictionaries, and each hook with them. The engine's hooks drive
its gathers, buffer broadcasts and state-dict views of *this* model; in a copy they would
run the original's collectives, or copy the engine itself. Wrapped here, a hook becomes
a no-op in any deep copy, so the copy is a plain module.

Under `torch.compile` the hooks stay out of the graph: each runs eagerly, with a graph
break where it is called. `EngineHook.__call__` is disabled for dynamo when the first hook
is made rather than at import, because `torch.compiler.disable` imports `torch._dynamo`
(about 100 MB of resident memory and a second), which `import zero_strategy` and the
consolidation command should not pay. It is disabled on the class, not per hook: dynamo
then never traces into a hook, so it guards on no hook's identity and never recompiles
for one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def _inert(*args: Any, **kwargs: Any) -> None:
    return None


def _run_engine_hook(hook: EngineHook, *args: Any, **kwargs: Any) -> Any:
    return hook.fn(*args, **kwargs)


class EngineHook:
    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        _keep_hooks_out_of_graphs()

    __call__ = _run_engine_hook  # made eager-only by the first hook (module docstring)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return _inert


@functools.cache
def _keep_hooks_out_of_graphs() -> None:
    EngineHook.__call__ = torch.compiler.disable(_run_engine_hook)
