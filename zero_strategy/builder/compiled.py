"""A model compiled before it is handed over: `torch.compile(model)`, or its blocks'
`block.compile()` (torchtitan's recipe).

`torch.compile(model)` returns a wrapper whose parameter names all begin `_orig_mod.`.
Sharded as it is, those names would go into every checkpoint, and a checkpoint would
load only into a model compiled the same way. The engine shards the module inside, under
the model's own names (Lightning and Accelerate unwrap it alike), and calls the wrapper.

Tensor parallelism does not compile in torch 2.13. Dynamo's fake tensors fail on a
DTensor whose local shard starts at a nonzero offset of its storage ("Attempted to set the
storage of a tensor on device cpu to a storage on different device meta"), and every
unit's flat buffer makes its shards so. A model compiled before the hand-over then runs
eagerly, with a warning that names the combination, instead of failing in the first
forward. `tests/test_compile.py` holds the bare reproduction as an expected failure.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from ..private_api import compiled_submodules, compiled_wrapper_inner, run_eagerly


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, Callable[..., Any]]:
    """(the module to shard, what a forward calls): the module inside a compiled
    wrapper and the wrapper, or the model twice."""
    inner = compiled_wrapper_inner(model)
    return (model, model) if inner is None else (inner, model)


def eager_under_tensor_parallelism(model: nn.Module, runner: Callable[..., Any]) -> nn.Module:
    """The model to call once its compiled parts are set back to eager, with a warning
    that says which were compiled."""
    blocks = compiled_submodules(model)
    if runner is model and not blocks:
        return model
    compiled = ["the whole model"] if runner is not model else []
    compiled += [name or "the model" for name in blocks][:3] + (["..."] if len(blocks) > 3 else [])
    warn_eager_under_tensor_parallelism(", ".join(compiled), stacklevel=5)  # the user's line
    for name in blocks:
        run_eagerly(model.get_submodule(name))
    return model


def warn_eager_under_tensor_parallelism(what: str, stacklevel: int = 3) -> None:
    """The warning for `what` was compiled, run eagerly instead (a framework's door that
    undoes its own compile says the same)."""
    warnings.warn(
        f"torch.compile with tensor parallelism ({what} compiled): torch 2.13's dynamo "
        "cannot trace DTensor shards that start inside a storage, which the engine's flat "
        "buffers make them. The model runs eagerly; compile without tensor parallelism, "
        "or leave the model uncompiled to silence this.",
        stacklevel=stacklevel,
    )
