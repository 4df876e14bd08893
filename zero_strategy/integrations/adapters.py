"""Saving what a fine-tune trains (a PEFT/LoRA adapter) from a sharded model.

PEFT's `save_pretrained` calls `model.state_dict()`, which at stage 3 gathers the whole
frozen base, on every rank, to keep the adapter's 0.1% of it. Handed the trainable
parameters instead, it writes the same files from a gather of the adapter's units alone:

    model.save_pretrained(out, is_main_process=rank == 0,
                          state_dict=zero_strategy.trainable_state_dict(model))

Collective: every rank calls it (the others get an empty dict, which PEFT writes nothing
from when `is_main_process` is False).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..comm.shutdown import live_engines

if TYPE_CHECKING:
    from ..engine import ZeroEngine


def engine_sharding(module: nn.Module) -> tuple[ZeroEngine, str]:
    """The live engine whose model holds `module`, and `module`'s name prefix in it."""
    for engine in live_engines():
        for name, candidate in engine.module.named_modules():
            if candidate is module:
                return engine, f"{name}." if name else ""
    raise ValueError(
        f"No ZeroEngine shards this {type(module).__name__}: pass the model (or a submodule "
        "of it) that the strategy, the Accelerator or ZeroEngine was given."
    )


def trainable_state_dict(module: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The consolidated fp32 values of `module`'s trainable parameters, by their names in
    `module`, gathered one unit at a time without gathering any frozen unit; empty on
    other ranks when `rank0_only`. Collective."""
    engine, prefix = engine_sharding(module)
    state = engine.full_state_dict(rank0_only=rank0_only, trainable_only=True)
    return {name[len(prefix) :]: value for name, value in state.items() if name.startswith(prefix)}
