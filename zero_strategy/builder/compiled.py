"""A model compiled before it is handed over: `torch.compile(model)`, or its blocks'
`block.compile()` (torchtitan's recipe).

`torch.compile(model)` returns a wrapper whose parameter names all begin `_orig_mod.`.
Sharded as it is, those names would go into every checkpoint, and a checkpoint would
load only into a model compiled the same way. The engine shards the module inside, under
the model's own names (Lightning and Accelerate unwrap it alike), and calls the wrapper.

Under tensor parallelism with torch 2.13, a DTensor parameter's local shard gets a
storage of its own (`FlatUnit.point_param_at`): that dynamo cannot fake a shard that
starts inside a storage (2.14's can), and `tests/test_compile.py` keeps the bare
reproduction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..private_api import compiled_wrapper_inner


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, Callable[..., Any]]:
    """(the module to shard, what a forward calls): the module inside a compiled
    wrapper and the wrapper, or the model twice."""
    inner = compiled_wrapper_inner(model)
    return (model, model) if inner is None else (inner, model)
