"""Weight averaging (EMA, SWA) for Lightning under the ZeRO strategy.

Lightning's `WeightAveraging`, `EMAWeightAveraging` and `StochasticWeightAveraging` read
and write `pl_module.parameters()` after each step. At stage 3 those are empty outside
forward, so the strategy adopts each stock callback (and a user's subclass) at set-up:
its hooks that read the weights run with the full parameters gathered
(`adopt_weight_callbacks`), and it trains as under DDP, keeping a whole averaged copy per
rank as there. At stages 1-2 and on one process they work as they are. The drop-ins:

- `ZeroEMAWeightAveraging`: `EMAWeightAveraging`'s arguments and schedule, over the
  engine's sharded EMA: 1/N of a copy per rank instead of a whole one, saved in the
  sharded checkpoints, swapped in for validation and into the model when training ends.
  Buffers (BatchNorm statistics) are not averaged: `use_buffers=False` in stock terms.
- `ZeroWeightAveraging`: the stock callback, any `avg_fn`, with the full parameters
  gathered wherever it reads or writes them. It keeps the stock's full averaged copy.
- `ZeroStochasticWeightAveraging`: the stock SWA with the same gathering.

The classes are built per Lightning package (`lightning.pytorch` or `pytorch_lightning`)
by `averaging_classes(root)`.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

from .engine_of import engine_of
from .lightning_callbacks import first_definer, user_hooks_between_steps

_CLASSES: dict[str, dict[str, type]] = {}
_ADOPTED = "_zero_gathers_in_hooks"  # set on a class whose hooks gather already

# The stock hooks that read or write the parameters, by stock class.
_DROP_IN_HOOKS: dict[str, tuple[str, ...]] = {
    "WeightAveraging": (
        "setup",
        "on_train_batch_end",
        "on_train_epoch_end",
        "on_train_end",
        "on_validation_epoch_start",
        "on_validation_epoch_end",
    ),
    "StochasticWeightAveraging": ("setup", "on_train_epoch_start", "on_train_end"),
    # Masks ranked from the weights, the lottery ticket's copy and reset, the pruning made
    # permanent (in the model, and in each checkpoint's state dict).
    "ModelPruning": (
        "setup",
        "on_train_epoch_end",
        "on_validation_epoch_end",
        "on_train_end",
        "on_save_checkpoint",
    ),
}


def _gathered(pl_module):
    """The full parameters for a `with` block, written back on exit (every rank writes
    the same values); nothing to do without an engine."""
    engine = engine_of(pl_module)
    return engine.gathered_parameters() if engine is not None else contextlib.nullcontext()


def _with_full_parameters(base: type, hooks: tuple[str, ...], name: str | None = None) -> type:
    """`base` with each hook in `hooks` run inside `_gathered(pl_module)`, named `name`
    (Zero<base> by default)."""

    def wrap(hook_name: str):
        inner = getattr(base, hook_name)

        def hook(self, trainer, pl_module, *args, **kwargs):
            with _gathered(pl_module):
                return inner(self, trainer, pl_module, *args, **kwargs)

        hook.__name__ = hook_name
        return hook

    members: dict[str, Any] = {hook: wrap(hook) for hook in hooks}
    members[_ADOPTED] = True
    cls = type(name or f"Zero{base.__name__}", (base,), members)
    if name:
        cls.__qualname__, cls.__module__ = base.__qualname__, base.__module__
    return cls


def averaging_classes(root: str) -> dict[str, type]:
    """The drop-ins for Lightning package `root`, by the stock class name they replace."""
    if root in _CLASSES:
        return _CLASSES[root]
    callbacks = importlib.import_module(f"{root}.callbacks")
    stock_ema = callbacks.EMAWeightAveraging

    class ZeroEMAWeightAveraging(callbacks.Callback):
        """`EMAWeightAveraging(decay, update_every_n_steps, update_starting_at_step,
        update_starting_at_epoch)` over the engine's sharded EMA (see the module)."""

        def __init__(
            self,
            decay: float = 0.999,
            update_every_n_steps: int = 1,
            update_starting_at_step: int | None = None,
            update_starting_at_epoch: int | None = None,
        ):
            if not 0.0 <= decay < 1.0:
                raise ValueError(f"decay must be in [0, 1), got {decay}; 0.999 is usual.")
            self.decay = decay
            self.update_every_n_steps = update_every_n_steps
            self.update_starting_at_step = update_starting_at_step
            self.update_starting_at_epoch = update_starting_at_epoch
            self._latest_update_step = 0
            self._latest_update_epoch = -1
            self._swapped = False

        should_update = stock_ema.should_update  # the stock schedule, unchanged

        def _engine(self, pl_module):
            engine = engine_of(pl_module)
            if engine is None:
                raise RuntimeError(
                    "ZeroEMAWeightAveraging needs the ZeRO strategy: use "
                    "Trainer(strategy='zero1'|'zero2'|'zero3'), or EMAWeightAveraging "
                    "with other strategies."
                )
            return engine

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            step_idx = trainer.global_step - 1  # zero-based, as the stock callback
            if trainer.global_step > self._latest_update_step and self.should_update(
                step_idx=step_idx
            ):
                self._engine(pl_module).update_ema(self.decay)
                self._latest_update_step = trainer.global_step

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            epoch = trainer.current_epoch
            if epoch > self._latest_update_epoch and self.should_update(epoch_idx=epoch):
                self._engine(pl_module).update_ema(self.decay)
                self._latest_update_epoch = epoch

        def _swap(self, trainer, pl_module) -> None:
            engine = self._engine(pl_module)
            if engine.ema_started:
                engine.swap_ema()
                self._swapped = not self._swapped

        def on_validation_epoch_start(self, trainer, pl_module) -> None:
            if trainer.state.fn == "fit":
                self._swap(trainer, pl_module)

        def on_validation_epoch_end(self, trainer, pl_module) -> None:
            if self._swapped:
                self._swap(trainer, pl_module)

        def on_train_end(self, trainer, pl_module) -> None:
            """The averaged weights stay in the model, as the stock callback leaves them
            (the trained ones are kept as the EMA state)."""
            if not self._swapped:
                self._swap(trainer, pl_module)
            self._swapped = False

        def state_dict(self) -> dict[str, Any]:
            return {
                "latest_update_step": self._latest_update_step,
                "latest_update_epoch": self._latest_update_epoch,
            }

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self._latest_update_step = state_dict["latest_update_step"]
            self._latest_update_epoch = state_dict.get("latest_update_epoch", -1)

    weight_averaging = _with_full_parameters(
        callbacks.WeightAveraging, _DROP_IN_HOOKS["WeightAveraging"]
    )
    swa = _with_full_parameters(
        callbacks.StochasticWeightAveraging, _DROP_IN_HOOKS["StochasticWeightAveraging"]
    )
    weight_averaging.__doc__ = "`WeightAveraging` with the full parameters gathered."
    swa.__doc__ = "`StochasticWeightAveraging` with the full parameters gathered."
    _CLASSES[root] = {
        "EMAWeightAveraging": ZeroEMAWeightAveraging,
        "WeightAveraging": weight_averaging,
        "StochasticWeightAveraging": swa,
    }
    return _CLASSES[root]


# Callback hooks Lightning calls between steps (never inside a forward or backward), on
# every rank: where a subclass's own hook may read the weights and a gather can run.
_PHASES = ("fit", "train", "validation", "test", "predict")
_EPOCHS = ("train_epoch", "validation_epoch", "test_epoch", "predict_epoch", "train_batch")
_OUTSIDE_FORWARD = (
    "setup",
    "teardown",
    *(f"on_{what}_{when}" for what in _PHASES + _EPOCHS for when in ("start", "end")),
)


def adopt_weight_callbacks(callbacks: list, root: str) -> None:
    """Stage 3 over several ranks: a stock callback that reads or writes the weights
    between steps (weight averaging, pruning; or a user's subclass of one) would see
    empty parameters after the first step. Each becomes its own class with the full
    parameters gathered in the hooks that touch them, the stock ones and any its subclass
    defines (the instance keeps its state and arguments; torch's `fully_shard` re-classes
    a module the same way)."""
    stock = importlib.import_module(f"{root}.callbacks")
    for callback in callbacks:
        if getattr(callback, _ADOPTED, False):  # a drop-in, or adopted by an earlier fit
            continue
        for name in ("StochasticWeightAveraging", "WeightAveraging", "ModelPruning"):
            base = getattr(stock, name)
            if isinstance(callback, base):
                cls = type(callback)
                own = [h for h in _OUTSIDE_FORWARD if first_definer(cls, h, base) is not None]
                hooks = tuple(dict.fromkeys(_DROP_IN_HOOKS[name] + tuple(own)))
                # Same name: its state_key (the checkpoint's entry) and messages unchanged.
                callback.__class__ = _with_full_parameters(cls, hooks, cls.__name__)
                break


def parameters_read_between_steps(trainer: Any, root: str, sharded: bool) -> bool:
    """Whether a callback or hook reads the parameters after each step (a stock averaging
    callback, a user's hook between steps): the step's parameter gathers are then
    finished first. With `sharded` parameters the stock averaging callbacks are swapped
    for drop-ins that average the shards (`lightning_averaging`)."""
    stock = importlib.import_module(f"{root}.callbacks")
    kinds = (stock.WeightAveraging, stock.StochasticWeightAveraging)
    kinds += tuple(averaging_classes(root).values())
    averaging = [c for c in trainer.callbacks if isinstance(c, kinds)]
    if sharded:
        adopt_weight_callbacks(trainer.callbacks, root)
    return bool(averaging) or user_hooks_between_steps(trainer, root)
