"""Lightning: `Trainer(strategy="zero3")`, an adapter over `ZeroEngine`.

The strategy subclasses Lightning's `DDPStrategy` for its launchers, rank handling and
collectives, but never wraps the model in DDP: `setup()` hands the LightningModule and its
optimizer to a `ZeroEngine`, and a precision plugin routes backward, clipping and the
optimizer step through the engine. Checkpoints are the engine's sharded directories, with
the trainer's own state (loops, callbacks, schedulers) saved beside them, loadable with
`torch.load(weights_only=True)`.

The same body serves `lightning.pytorch` and `pytorch_lightning` (separate class
hierarchies, separate registries): `make_strategy(pl)` builds the class for either.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Mapping
from typing import Any

import torch

from zero_strategy import ZeroConfig, ZeroEngine

from .engine_of import attach, engine_of
from .lightning_averaging import averaging_classes, parameters_read_between_steps
from .lightning_callbacks import ends_an_epoch, shards_parameters
from .lightning_checkpoints import CheckpointMethods
from .lightning_placement import DevicePlacement
from .lightning_steps import StepRedirection
from .pairing import stand_in_optimizer
from .private_api import (
    layer_sync,
    route_lightning_optimizers_zero_grad,
    run_after_closure,
)
from .strategy_config import (
    PRECISIONS,
    config_for_precision,
    default_dtype,
    register_zero_names,
    signature_with_config_fields,
    zero_config_from,
)
from .whole_checkpoint import check_state_dict_type


def make_precision(root: str):
    base = importlib.import_module(f"{root}.plugins.precision").Precision

    class ZeroPrecision(base):
        """Backward, clipping and the step go through the engine (global norm over all
        shards, fp16 loss scaling with skips agreed across ranks)."""

        def __init__(self, precision: str, strategy, true_dtype: torch.dtype | None = None):
            super().__init__()
            self.precision = precision
            self._strategy = strategy
            self._autocast = PRECISIONS[precision][1]
            # "64-true", "bf16-true", "16-true": tensors made in a step (torch.tensor(...),
            # torch.zeros(...)) take that dtype, as Lightning's own plugins make them
            # ("32-true" leaves torch's default as it is, as Lightning's does).
            self._true_dtype = None if true_dtype == torch.float32 else true_dtype
            self.device = strategy.root_device.type  # as Lightning's MixedPrecision has it

        def forward_context(self):
            if self._true_dtype is not None:
                return default_dtype(self._true_dtype)
            if self._autocast is None:
                return contextlib.nullcontext()
            device = self._strategy.root_device.type
            return torch.autocast(device, dtype=self._autocast)

        def tensor_init_context(self):
            if self._true_dtype is None:
                return contextlib.nullcontext()
            return default_dtype(self._true_dtype)

        def module_init_context(self):
            return self.tensor_init_context()

        def convert_input(self, data: Any) -> Any:
            dtype = self._strategy.engine_config.compute_torch_dtype
            if dtype == torch.float32:
                return data
            from lightning_utilities.core.apply_func import apply_to_collection

            return apply_to_collection(
                data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t
            )

        def backward(self, tensor, model, optimizer, *args, **kwargs):
            model.backward(self._strategy.engine.scale_loss(tensor), *args, **kwargs)

        def optimizer_step(self, optimizer, model, closure, **kwargs):
            closure_result = closure()
            run_after_closure(self, model, optimizer)
            skip = model.automatic_optimization and closure_result is None
            if not skip:
                self._strategy.engine.step(optimizer)
                if self._strategy.parameters_read_after_step or ends_an_epoch(model.trainer):
                    self._strategy.engine.wait_for_parameters()
            return closure_result

        def clip_grad_by_norm(self, optimizer, clip_val) -> None:
            self._strategy.engine.clip_grad_norm_(float(clip_val), optimizer)

        def clip_grad_by_value(self, optimizer, clip_val) -> None:
            self._strategy.engine.clip_grad_value_(float(clip_val), optimizer)

    return ZeroPrecision


def make_strategy(root: str):
    """The ZeRO strategy class for `root` ("lightning.pytorch" or "pytorch_lightning").
    Only its strategies module is needed now: this may run while the framework is still
    being imported; the rest is looked up at setup()."""
    DDPStrategy = importlib.import_module(f"{root}.strategies").DDPStrategy
    precision_class: list[type] = []

    class ZeroStrategy(CheckpointMethods, StepRedirection, DevicePlacement, DDPStrategy):
        """ZeRO stages 1-3 over `ZeroEngine`. `ZeroStrategy(stage=3, gradient_clipping=0,
        ...)` takes any ZeroConfig field, or `config=ZeroConfig(...)`. Checkpoints are
        sharded directories, or with `state_dict_type="full"` one file that Lightning's
        loaders and `torch.load(weights_only=True)` open (`lightning_checkpoints.py`).
        The user's steps run inside the engine's bookkeeping (`lightning_steps.py`); the
        model and its data are placed as `lightning_placement.py` says."""

        strategy_name = "zero"

        def __init__(
            self,
            stage: int | None = None,
            config: ZeroConfig | Mapping | None = None,
            accelerator=None,
            parallel_devices=None,
            cluster_environment=None,
            checkpoint_io=None,
            precision_plugin=None,
            process_group_backend: str | None = None,
            start_method: str = "popen",
            state_dict_type: str = "sharded",
            pretrained: str | os.PathLike | None = None,
            **zero_options: Any,
        ):
            self._zero_base = zero_config_from(stage, config, zero_options)  # validates early
            # Safetensors weights (a file, a directory, a Hub-style sharded set) read into
            # the sharded model once fit() first shards it: each rank reads its ranges.
            self.pretrained = pretrained
            # "full": each checkpoint one file, as FSDPStrategy(state_dict_type="full").
            self.state_dict_type = check_state_dict_type(state_dict_type, "ZeroStrategy")
            super().__init__(
                accelerator=accelerator,
                parallel_devices=parallel_devices,
                cluster_environment=cluster_environment,
                checkpoint_io=checkpoint_io,
                precision_plugin=precision_plugin,
                process_group_backend=process_group_backend,
                start_method=start_method,
            )
            self.engine: ZeroEngine | None = None
            self.engine_config = self._zero_base
            self._device_mesh = None
            self._true_dtype: torch.dtype | None = None
            # A stock averaging callback reads the parameters after each step (stages 1-2:
            # the step's parameter gathers are finished first, not overlapped).
            self.parameters_read_after_step = False

        @classmethod
        def register_strategies(cls, strategy_registry) -> None:
            register_zero_names(cls, strategy_registry)

        @property
        def is_distributed(self) -> bool:
            return True

        # ------------------------------------------------------------ set-up
        def setup(self, trainer) -> None:
            assert self.accelerator is not None
            self.accelerator.setup(trainer)
            self._take_precision()
            sharded = shards_parameters(self.engine_config, self.world_size, self.root_device)
            self.parameters_read_after_step = parameters_read_between_steps(trainer, root, sharded)
            model = self.lightning_module
            existing = engine_of(model)
            sync = layer_sync(self)
            if trainer.state.fn == "fit" and sync and existing is None:
                self.model = sync.apply(self.model)  # sync_batchnorm=True
                model = self.lightning_module
            self.model_to_device()
            if existing is not None and trainer.state.fn != "fit":
                # Sharded by an earlier run: evaluation reuses that engine as it is.
                self.engine = existing
                self.model = model
                return
            if existing is not None:
                # fit() again (more epochs, or after an exception): configure_optimizers
                # builds new optimizers over model.parameters(), as under DDP, so the
                # module is handed back whole and sharded again around them.
                existing.release_module()
                attach(model, None)
            self._shard(trainer, model)
            if self.pretrained is not None and existing is None:
                self.engine.load_pretrained(self.pretrained)

        def _take_precision(self) -> None:
            """The engine's config with the compute dtype the precision flag gives, and the
            precision plugin that runs backward, clipping and the step through it.
            "64-true", "bf16-true": the whole module in that dtype, buffers too, as
            Lightning's own plugin converts it (the engine casts the parameters)."""
            flag, self.engine_config = config_for_precision(
                self.precision_plugin, self._zero_base, "Trainer"
            )
            compute_dtype = self.engine_config.compute_torch_dtype
            self._true_dtype = compute_dtype if flag.endswith("true") or flag == "64" else None
            if not precision_class:
                precision_class.append(make_precision(root))
            self.precision_plugin = precision_class[0](flag, self, self._true_dtype)

        def _shard(self, trainer, model) -> None:
            """Hand the module and its optimizers (several, a GAN's, each sharded; a
            stand-in for evaluation) to a new engine."""
            if trainer.state.fn == "fit":  # TrainerFn is a str enum
                self.setup_optimizers(trainer)
                optimizer = list(self.optimizers)
            else:
                optimizer = stand_in_optimizer(model)  # evaluation only
            self.engine = ZeroEngine(
                model,
                optimizer,
                self.engine_config,
                device=self.root_device,
                device_mesh=self._device_mesh,
            )
            attach(model, self.engine)
            if trainer.state.fn == "fit":  # opt.zero_grad() in a step: the engine's at once
                route_lightning_optimizers_zero_grad(self)
            self.model = model

        def teardown(self) -> None:
            """DDP's teardown without moving the module and optimizer state to the CPU: on
            CUDA that would re-allocate every parameter away from the engine's buffers
            (which later validate/test calls reuse). The engine's process groups are
            destroyed here, and re-created when a later call (a save, an evaluation) uses
            them."""
            if self.engine is not None:
                self.engine.close()
            # Unlike DDP, SyncBatchNorm is not reverted after fit: the engine's hooks (and,
            # at stage 3, its gathers) live on those modules, which later validate/test
            # calls reuse. In eval mode SyncBatchNorm uses its running statistics, as
            # BatchNorm does.
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()

    ZeroStrategy.__name__ = ZeroStrategy.__qualname__ = "ZeroStrategy"
    ZeroStrategy.__init__.__signature__ = signature_with_config_fields(ZeroStrategy.__init__)
    return ZeroStrategy


_CLASSES: dict[str, type] = {}


def register(root: str):
    """Add zero1..zero3 to the strategy registry of `root`; returns the strategy class."""
    if root not in _CLASSES:
        cls = make_strategy(root)
        registry = importlib.import_module(f"{root}.strategies").StrategyRegistry
        if "zero3" not in registry:
            cls.register_strategies(registry)
        _CLASSES[root] = cls
    return _CLASSES[root]


def __getattr__(name: str):
    """`from zero_strategy.integrations.lightning import ZeroStrategy`: the class for
    `lightning.pytorch` (use `register("pytorch_lightning")` for the other package)."""
    if name == "ZeroStrategy":
        return register("lightning.pytorch")
    drop_ins = {f"Zero{stock}": stock for stock in averaging_classes("lightning.pytorch")}
    if name in drop_ins:  # ZeroEMAWeightAveraging, ZeroWeightAveraging, ...
        return averaging_classes("lightning.pytorch")[drop_ins[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
