"""torch's `ZeroRedundancyOptimizer` handed to the engine.

It is ZeRO stage 1 over DDP: each rank steps its own part of the parameters and
broadcasts them. Under the engine that sharding is the engine's, so the optimizer class it
wraps does the steps, built over the wrapper's own param group dicts (the same dicts, so
an LR scheduler built on the wrapper changes the learning rate that steps). The wrapper
stays the user's object: the frameworks hold it, step it and zero it through the engine.
A DDP user's `configure_optimizers` that returns one trains unchanged.

Its own `consolidate_state_dict()`, `state_dict()` and `load_state_dict()` would speak for
the optimizer torch built inside it, which never steps here: a save through them would
keep an empty state without a word. They raise instead, naming the engine's checkpoint.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch

from .shard_views import UnsupportedOptimizerError


def is_zero_redundancy_optimizer(optimizer: object) -> bool:
    """Read without importing `torch.distributed.optim` (0.2 s of TorchScript compiling
    per process): an instance exists only once its module has been imported."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def stepping_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that takes `optimizer`'s steps: itself, or for a
    ZeroRedundancyOptimizer one of the class it wraps, over all of its param groups."""
    if not is_zero_redundancy_optimizer(optimizer):
        return optimizer
    local = getattr(optimizer, "optim", None)  # this rank's part, in the wrapped class
    if not isinstance(local, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            "ZeroRedundancyOptimizer(overlap_with_ddp=True) steps inside DDP's gradient "
            "hook, which the ZeRO engine replaces. Build it without overlap_with_ddp, or "
            "pass the optimizer it wraps, built directly (e.g. torch.optim.AdamW("
            "model.parameters(), lr=...))."
        )
    if getattr(optimizer, "parameters_as_bucket_view", False):
        raise UnsupportedOptimizerError(
            "ZeroRedundancyOptimizer(parameters_as_bucket_view=True) keeps every parameter "
            "in buckets of its own, a whole copy of the model on each rank beside the "
            "engine's shards. Build it without parameters_as_bucket_view."
        )
    if any(_has_stepped(state) for state in local.state.values()):
        raise UnsupportedOptimizerError(
            "This ZeroRedundancyOptimizer has stepped already: its state is spread over the "
            "ranks as DDP's ZeRO-1 keeps it and would be lost. Hand it to the engine before "
            "its first step, or load its state after, through the engine's checkpoint."
        )
    cls = type(local)
    accepted = inspect.signature(cls).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    defaults = {k: v for k, v in local.defaults.items() if takes_any or k in accepted}
    return cls(optimizer.param_groups, **defaults)


def _has_stepped(state: dict) -> bool:
    """Adagrad makes its state (a zero step count, the initial sums) when it is built."""
    return float(state["step"]) > 0 if "step" in state else bool(state)


# The wrapper's calls that read or write the state of the optimizer torch built inside it.
_STATE_CALLS = ("consolidate_state_dict", "state_dict", "load_state_dict")


def refuse_state_calls(optimizer: torch.optim.Optimizer) -> None:
    """From now on, a ZeroRedundancyOptimizer's state calls raise (see the module's
    docstring); any other optimizer is left as it is."""
    if is_zero_redundancy_optimizer(optimizer):
        for name in _STATE_CALLS:
            setattr(optimizer, name, functools.partial(_refuse, name))


def _refuse(name: str, *args: object, **kwargs: object) -> None:
    raise RuntimeError(
        f"ZeroRedundancyOptimizer.{name}() speaks for the optimizer torch built inside it, "
        "which never steps under the ZeRO engine (the engine shards and steps the state "
        "itself), so it would save or load nothing. Save and load the optimizer state with "
        "the engine's checkpoint: engine.save_checkpoint(dir) and engine.load_checkpoint("
        "dir), which Lightning's, Fabric's and Accelerate's checkpoints call for you."
    )
