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
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from zero_strategy import ZeroConfig, ZeroEngine, init_on_meta
from zero_strategy.comm.shutdown import destroy_default_group_at_exit
from zero_strategy.tensor_parallel import tensor_parallel_mesh

from .client_state import client_state
from .devices import place_buffers, require_cpu_or_cuda
from .engine_of import attach, engine_of
from .lightning_averaging import adopt_weight_callbacks, averaging_classes
from .lightning_callbacks import (
    ends_an_epoch,
    shards_parameters,
    user_hooks_between_steps,
)
from .lightning_model_state import (
    EngineModelState,
    after_loading,
    for_saving,
    in_module_order,
    model_key,
)
from .pairing import stand_in_optimizer
from .private_api import (
    dumping_a_checkpoint,
    give_device_mesh,
    layer_sync,
    route_lightning_optimizers_zero_grad,
    run_after_closure,
)
from .strategy_config import (
    PRECISIONS,
    compute_dtype_for,
    default_dtype,
    precision_flag,
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

    class ZeroStrategy(DDPStrategy):
        """ZeRO stages 1-3 over `ZeroEngine`. `ZeroStrategy(stage=3, gradient_clipping=0,
        ...)` takes any ZeroConfig field, or `config=ZeroConfig(...)`. Checkpoints are
        sharded directories, or with `state_dict_type="full"` one file that Lightning's
        loaders and `torch.load(weights_only=True)` open (`whole_checkpoint.py`)."""

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

        # ------------------------------------------------------------ registry
        @classmethod
        def register_strategies(cls, strategy_registry) -> None:
            register_zero_names(cls, strategy_registry)

        @property
        def is_distributed(self) -> bool:
            return True

        # ------------------------------------------------------------ set-up
        def setup_environment(self) -> None:
            require_cpu_or_cuda(self.root_device, "Trainer")
            super().setup_environment()
            destroy_default_group_at_exit()  # a gloo group alive at exit can abort
            # Tensor parallelism: the mesh ModelParallelStrategy gives, under its names, so
            # that a configure_model() written for it applies its plan here unchanged.
            self._device_mesh = tensor_parallel_mesh(
                self._zero_base.tensor_parallel_size, self.world_size, self.root_device
            )
            if self._device_mesh is not None:
                give_device_mesh(self.lightning_module, self._device_mesh)

        @property
        def device_mesh(self):
            """The (data_parallel, tensor_parallel) mesh, with tensor_parallel_size > 1."""
            return self._device_mesh

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            """Tensor-parallel ranks read the same batches: the sampler splits the data over
            the data-parallel ranks only."""
            if self._device_mesh is None:
                return super().distributed_sampler_kwargs
            data = self._device_mesh["data_parallel"]
            return {"num_replicas": data.size(), "rank": data.get_local_rank()}

        def setup(self, trainer) -> None:
            assert self.accelerator is not None
            self.accelerator.setup(trainer)
            flag = precision_flag(self.precision_plugin, "Trainer")
            compute = compute_dtype_for(flag, self._zero_base, "Trainer")
            self.engine_config = ZeroConfig.from_dict(
                {**vars(self._zero_base), "compute_dtype": compute}
            )
            # "64-true", "bf16-true": the whole module in that dtype, buffers too, as
            # Lightning's own plugin converts it (the engine casts the parameters).
            compute_dtype = self.engine_config.compute_torch_dtype
            self._true_dtype = compute_dtype if flag.endswith("true") or flag == "64" else None
            if not precision_class:
                precision_class.append(make_precision(root))
            self.precision_plugin = precision_class[0](flag, self, self._true_dtype)
            model = self.lightning_module
            stock = importlib.import_module(f"{root}.callbacks")
            kinds = (stock.WeightAveraging, stock.StochasticWeightAveraging)
            kinds += tuple(averaging_classes(root).values())
            averaging = [c for c in trainer.callbacks if isinstance(c, kinds)]
            if shards_parameters(self.engine_config, self.world_size, self.root_device):
                adopt_weight_callbacks(trainer.callbacks, root)
            self.parameters_read_after_step = bool(averaging) or user_hooks_between_steps(
                trainer, root
            )
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
            if trainer.state.fn == "fit":  # TrainerFn is a str enum
                self.setup_optimizers(trainer)  # several (a GAN's) are each sharded
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
            if self.pretrained is not None and existing is None:
                self.engine.load_pretrained(self.pretrained)

        def model_to_device(self) -> None:
            """Buffers only: the engine copies each unit's parameters onto the device as it
            shards them, so the whole model never sits on one device at once."""
            place_buffers(self.model, self.root_device, self._true_dtype)

        @contextlib.contextmanager
        def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
            """`trainer.init_module()`, as Lightning's FSDP strategy: with empty_init=True
            on the meta device (the engine materialises each rank's shard), otherwise in
            CPU memory; never the whole model on the device, as the DDP base would."""
            meta = init_on_meta() if empty_init else contextlib.nullcontext()
            with meta, self.precision_plugin.tensor_init_context():
                yield

        @contextlib.contextmanager
        def model_sharded_context(self) -> Iterator[None]:
            """configure_model() runs here: modules are built on the meta device (a
            tensor-parallel plan applied there too) and the engine materializes only this
            rank's shard, one unit at a time."""
            with init_on_meta():
                yield

        @contextlib.contextmanager
        def block_backward_sync(self) -> Iterator[None]:
            with self.engine.no_sync() if self.engine is not None else contextlib.nullcontext():
                yield

        def _around_forward(self, name: str, *args, **kwargs):
            """The user's step runs the model through submodules, not the root's forward:
            run the engine's forward bookkeeping around it (buffer broadcast, an outside
            zero_grad, the root unit gathered at stage 3), as DDP's and FSDP's forward
            redirection does through the root's forward."""
            if self.engine is None:
                return getattr(super(), name)(*args, **kwargs)
            self.engine.begin_step()
            output = None
            try:
                output = getattr(super(), name)(*args, **kwargs)
                return output
            finally:
                self.engine.after_forward(output)

        def training_step(self, *args, **kwargs):
            output = self._around_forward("training_step", *args, **kwargs)
            self.engine.honour_outside_zero_grad()  # an opt.zero_grad() in the step
            return output

        def _evaluation_step(self, name: str, *args, **kwargs):
            try:
                return self._around_forward(name, *args, **kwargs)
            finally:
                if self.engine is not None and not torch.is_grad_enabled():
                    self.engine.reshard()

        def validation_step(self, *args, **kwargs):
            return self._evaluation_step("validation_step", *args, **kwargs)

        def test_step(self, *args, **kwargs):
            return self._evaluation_step("test_step", *args, **kwargs)

        def predict_step(self, *args, **kwargs):
            return self._evaluation_step("predict_step", *args, **kwargs)

        # ------------------------------------------------------------ checkpoints
        @property
        def restore_checkpoint_after_setup(self) -> bool:
            return True

        # Without an engine in this process (the main process after a spawned fit, which
        # got rank 0's trained weights back in a plain module), the module is whole on
        # its own: it is saved and restored as DDP does it, one file through the
        # checkpoint IO.
        @property
        def lightning_restore_optimizer(self) -> bool:
            return self.engine is None  # else the engine restores its sharded state

        def lightning_module_state_dict(self) -> dict[str, Any]:
            """The whole model's state on rank 0 (fp32, in CPU memory, gathered one unit
            at a time; empty elsewhere), as FSDPStrategy's "full" hands it. Collective.
            When Lightning fills a checkpoint with it: an empty marker that a callback
            moving the state dict carries along (`lightning_model_state.py`), the engine
            writing the model from its shards."""
            if self.engine is None:
                return super().lightning_module_state_dict()
            if dumping_a_checkpoint():
                return EngineModelState()
            return in_module_order(self.engine.full_state_dict(), self.lightning_module)

        def optimizer_state(self, optimizer) -> dict[str, Any]:
            """torch's `state_dict()` of `optimizer` unsharded, on rank 0 (empty
            elsewhere). Collective. Empty when a checkpoint is filled: the engine writes
            the optimizer state from its shards."""
            if self.engine is None:
                return super().optimizer_state(optimizer)
            if dumping_a_checkpoint():
                return {}
            return self.engine.full_optimizer_state_dict(optimizer)

        def save_checkpoint(
            self, checkpoint: dict[str, Any], filepath, storage_options=None
        ) -> None:
            if storage_options is not None:
                raise TypeError(
                    "The ZeRO strategy writes its own sharded directory; storage_options are "
                    "not supported. Drop them or use a CheckpointIO with strategy='ddp'."
                )
            if self.engine is None:
                super().save_checkpoint(checkpoint, filepath)
                return
            # Rank 0's path, as Lightning's FSDP and DeepSpeed strategies take it: ranks
            # may name different ones (each its own temporary directory), and the
            # sharded files must land together.
            filepath = self.broadcast(str(filepath), src=0)
            key = model_key(checkpoint)
            leave_out, added = for_saving(checkpoint, key)
            client = {**client_state(checkpoint, drop_keys=leave_out), **added}
            one_file = self.state_dict_type == "full"
            self.engine.save_checkpoint(str(filepath), client, one_file=one_file)

        def load_checkpoint(
            self, checkpoint_path, weights_only: bool | None = None
        ) -> dict[str, Any]:
            if self.engine is None:
                return super().load_checkpoint(checkpoint_path, weights_only)
            # Evaluation runs hold a stand-in optimizer: read the model alone.
            fitting = self.lightning_module.trainer.state.fn == "fit"
            client = self.engine.load_checkpoint(str(checkpoint_path), fitting) or {}
            after_loading(client, lambda: self.engine.full_state_dict(rank0_only=False))
            return client

        def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
            state = checkpoint.get("state_dict")
            if self.engine is None:
                super().load_model_state_dict(checkpoint, strict)
            elif state and not isinstance(state, EngineModelState):
                # A callback's in place of the model's (WeightAveraging's averaged
                # weights): loaded as DDP loads it; the engine loaded the model already.
                self.lightning_module.load_state_dict(state, strict=strict)

        def load_optimizer_state_dict(self, checkpoint) -> None:
            pass

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
