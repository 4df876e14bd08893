"""Every private name of Lightning, Fabric, Accelerate and Transformers the integrations
use, in one place, each checked against the installed version by
`tests/test_integrations_private_api.py`.

Each is a name the framework's own strategies and plugins use the same way, with no
public route in the versions below; a release that moves one fails in that test, naming
it. Torch's private names are the core's (`zero_strategy.private_api`).

Two process-wide effects remain, each because no public route exists:
- `import zero_strategy` registers "zero1".."zero3" with Lightning's and Fabric's strategy
  registries and Hydra's ConfigStore. Frameworks already imported are registered at once;
  for the others an import hook (`integrations/__init__.py`) registers them right after
  their module loads, and removes itself once all are done. Lightning 2.6 and Fabric read
  no entry points for strategies, and importing Lightning eagerly would cost every
  `import zero_strategy` seconds.
- `ZeroTrainer` builds its Accelerator by swapping `transformers.trainer.Accelerator` for
  the duration of `create_accelerator_and_postprocess()` (under a lock): Transformers
  builds it from that module global, with no hook for another class.
"""

from __future__ import annotations

import sys
from typing import Any

CHECKED_AGAINST = {"lightning": "2.6.6", "accelerate": "1.16.0", "transformers": "5.24.0"}


# ---------------------------------------------------------------- Lightning
def run_after_closure(precision: Any, model: Any, optimizer: Any) -> None:
    """`Precision._after_closure`: `on_before_optimizer_step` and gradient clipping,
    between the training closure and the optimizer step, as Lightning's AMP, DeepSpeed
    and FSDP plugins run them."""
    precision._after_closure(model, optimizer)


def layer_sync(strategy: Any) -> Any:
    """`ParallelStrategy._layer_sync`: Lightning sets it for `sync_batchnorm=True` on any
    strategy that has the attribute."""
    return strategy._layer_sync


def route_lightning_optimizers_zero_grad(strategy: Any) -> None:
    """`Strategy._lightning_optimizers`: the `LightningOptimizer`s that
    `LightningModule.optimizers()` hands out. A wrapper runs the optimizer class's methods
    on itself, so the `zero_grad` the engine put on the optimizer object is not what
    `opt.zero_grad()` in a training step runs: each wrapper gets its optimizer's."""
    for wrapper in strategy._lightning_optimizers:
        wrapper.zero_grad = wrapper.optimizer.zero_grad


def dumping_a_checkpoint() -> bool:
    """Whether Lightning's `_CheckpointConnector` asks, filling a checkpoint: the caller
    of the strategy method calling this (past a subclass's `super()` chain of it) is
    `_get_lightning_module_state_dict` or `dump_checkpoint`. There the ZeRO strategy
    hands markers (the checkpoint `Strategy.save_checkpoint` then gets is written from
    the shards) instead of gathering the whole state; a callback's or the module's
    `on_save_checkpoint` asking during the same save gets the whole state, as any user
    code does. Lightning tells a strategy no other way."""
    method = sys._getframe(1)
    caller = method.f_back
    while caller is not None and caller.f_code.co_name == method.f_code.co_name:
        caller = caller.f_back
    if caller is None or caller.f_code.co_name not in _CHECKPOINT_CONNECTOR_ASKS:
        return False
    return type(caller.f_locals.get("self")).__name__ == "_CheckpointConnector"


_CHECKPOINT_CONNECTOR_ASKS = ("_get_lightning_module_state_dict", "dump_checkpoint")


def give_device_mesh(module: Any, mesh: Any) -> None:
    """`LightningModule._device_mesh`: what `self.device_mesh` reads in `configure_model`
    (a read-only property, written the same way by Lightning's ModelParallelStrategy)."""
    module._device_mesh = mesh


def report_placement(module: Any, device: Any, dtype: Any) -> None:
    """`_DeviceDtypeModuleMixin._device` / `._dtype`: what `LightningModule.device` and
    `.dtype` report, where the engine put the buffers (`module.to()` would move the
    parameters the engine places, and the `dtype` setter refuses)."""
    if hasattr(module, "_device"):
        module._device = device
    if dtype is not None and hasattr(module, "_dtype"):
        module._dtype = dtype


def backward_sync_control_base() -> type:
    """Fabric's `_BackwardSyncControl`, the base of what `fabric.no_backward_sync` asks a
    strategy for (Fabric's own strategies subclass it)."""
    from lightning.fabric.strategies.strategy import _BackwardSyncControl

    return _BackwardSyncControl


def set_backward_sync_control(strategy: Any, control: Any) -> None:
    """`Strategy._backward_sync_control`: what Fabric reads on every `no_backward_sync`."""
    strategy._backward_sync_control = control


# ---------------------------------------------------------------- Accelerate
def mark_prepared(optimizer: Any) -> None:
    """`_is_accelerate_prepared`: Accelerate's marker that an optimizer is wrapped
    already, so `prepare_optimizer` keeps it as it is."""
    optimizer._is_accelerate_prepared = True


# ---------------------------------------------------------------- Transformers
# The private methods of `transformers.Trainer` that `ZeroTrainer` overrides or calls,
# each for a step Transformers offers no hook into: the model left unwrapped, the
# consolidated save, the sharded optimizer state saved and loaded with each checkpoint,
# and the best model loaded from its shards.
TRAINER_METHODS = (
    "_wrap_model",
    "_save",
    "_save_optimizer_and_scheduler",
    "_load_optimizer_and_scheduler",
    "_load_best_model",
)
