"""What Lightning's callbacks that read the weights between steps need from the strategy.

Stage 3 keeps the parameters sharded outside forward (empty tensors), and stages 1-2
finish a step's parameter gathers during the next forward. A callback that reads the
weights between steps (at an epoch's end: ModelPruning, a user's statistics) must find
them whole and current.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from zero_strategy import ZeroConfig
from zero_strategy.offload import keeps_stage_3


def shards_parameters(config: ZeroConfig, world_size: int, device: torch.device) -> bool:
    """Whether the engine keeps stage 3 (parameters empty outside forward): over several
    ranks, or on one whose parameter shards are offloaded."""
    return config.stage == 3 and (world_size > 1 or keeps_stage_3(config, device))


def ends_an_epoch(trainer: Any) -> bool:
    """Whether the step running now is the last of its epoch or of the training (by
    max_steps): the epoch-end callbacks run next, before any forward, so that step
    finishes its parameter gathers at once. Not known in advance: a step that takes the
    dataloader iterator, and an end by max_time or should_stop."""
    last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    max_steps = trainer.max_steps
    return bool(last_batch) or (max_steps >= 0 and trainer.global_step + 1 >= max_steps)


# The hooks Lightning runs between one step's optimizer step and the next forward.
_BETWEEN_STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end")


def user_hooks_between_steps(trainer: Any, root: str) -> bool:
    """Whether code outside Lightning (the LightningModule, a user's callback) defines a
    hook between steps, where it may read the weights: at stages 1-2 a step then finishes
    its parameter gathers at once, instead of in the next forward, so that they read the
    updated weights, as under DDP."""
    bases = [(trainer.lightning_module, importlib.import_module(root).LightningModule)]
    callback_base = importlib.import_module(f"{root}.callbacks").Callback
    bases += [(callback, callback_base) for callback in trainer.callbacks]
    package = root.split(".")[0] + "."
    for obj, base in bases:
        for hook in _BETWEEN_STEP_HOOKS:
            definer = first_definer(type(obj), hook, base)
            if definer is not None and not definer.__module__.startswith(package):
                return True
    return False


def first_definer(cls: type, hook: str, base: type) -> type | None:
    """The first class of `cls`'s MRO above `base` that defines `hook` (a subclass's
    override), or None when only `base` and its own bases do."""
    for klass in cls.__mro__:
        if klass is base:
            return None
        if hook in vars(klass):
            return klass
    return None
