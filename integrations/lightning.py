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
import dataclasses
import importlib
import inspect
import typing
import warnings
from collections.abc import Iterator, Mapping
from pathlib import PurePath
from typing import Any

import torch

from zero_strategy import ZeroConfig, ZeroEngine, init_on_meta
from zero_strategy.deepspeed_config import from_deepspeed_config, looks_like_deepspeed_config

from .devices import place_buffers, require_cpu_or_cuda
from .lightning_summary import patch_model_summary_callback

PRECISIONS = {
    # Lightning flag -> (engine compute dtype, autocast dtype or None)
    "32-true": ("fp32", None),
    "32": ("fp32", None),
    "bf16-mixed": ("fp32", torch.bfloat16),
    "bf16-true": ("bf16", None),
    "16-mixed": ("fp16", None),  # fp16 compute, fp32 masters, dynamic loss scaling
    "16-true": ("fp16", None),
}


def zero_config_from(
    stage: int | None, config: ZeroConfig | Mapping | None, options: dict
) -> ZeroConfig:
    """One ZeroConfig from the strategy's arguments; unknown options list the known ones.
    `config` may also be a DeepSpeed config (a dict with `zero_optimization`, or the path
    of its JSON file)."""
    values: dict[str, Any] = {}
    if isinstance(config, (str, PurePath)) or (
        isinstance(config, Mapping) and looks_like_deepspeed_config(config)
    ):
        config = from_deepspeed_config(config)
    if isinstance(config, ZeroConfig):
        values.update(vars(config))
    elif config is not None:
        values.update(dict(config))
    values.update(options)
    if stage is not None:
        values["stage"] = stage
    return ZeroConfig.from_dict(values)


def to_weights_only(value: Any, where: str = "checkpoint") -> Any:
    """Trainer state reduced to what `torch.load(weights_only=True)` accepts: containers,
    numbers, strings, tensors. Anything else is kept as its repr, with a warning."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor, torch.Size)):
        return value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, Mapping):
        return {k: to_weights_only(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [to_weights_only(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    warnings.warn(
        f"{where} holds a {type(value).__name__}, which safe loading cannot restore; it is "
        "saved as its repr(). Keep trainer state to numbers, strings, tensors and containers.",
        stacklevel=2,
    )
    return repr(value)


def compute_dtype_for(flag: str, base: ZeroConfig, entry: str) -> str:
    """The framework's precision flag decides the engine's compute dtype; a different one
    asked for in the strategy's config (e.g. a DeepSpeed config with bf16 enabled) is
    named in a warning rather than dropped silently."""
    compute = PRECISIONS[flag][0]
    if base.compute_dtype not in ("fp32", compute):
        warnings.warn(
            f"The ZeRO config asks for compute_dtype={base.compute_dtype!r}, but "
            f"{entry}(precision={flag!r}) decides the precision and gives {compute!r}. Set "
            f"{entry}(precision=...) to choose (e.g. 'bf16-true' or 'bf16-mixed').",
            stacklevel=3,
        )
    return compute


def register_zero_names(cls: type, registry) -> None:
    """zero1..zero3 in a Lightning or Fabric strategy registry."""
    for stage in (1, 2, 3):
        registry.register(
            f"zero{stage}", cls, description=f"ZeRO stage {stage} (zero-strategy)", stage=stage
        )


def signature_with_config_fields(init) -> inspect.Signature:
    """`__init__(..., **zero_options)` with each ZeroConfig field spelled out as a typed
    keyword, so that tools that read signatures (LightningCLI / jsonargparse configs with
    `class_path: ...ZeroStrategy`, `init_args: {stage: 3, bucket_size: ...}`) accept them."""
    base = inspect.signature(init)
    hints = typing.get_type_hints(ZeroConfig)
    params = [p for p in base.parameters.values() if p.kind is not p.VAR_KEYWORD]
    named = {p.name for p in params}
    for f in dataclasses.fields(ZeroConfig):
        if f.name in named:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        params.append(
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hints[f.name]
            )
        )
    return base.replace(parameters=params)


def make_precision(root: str):
    base = importlib.import_module(f"{root}.plugins.precision").Precision

    class ZeroPrecision(base):
        """Backward, clipping and the step go through the engine (global norm over all
        shards, fp16 loss scaling with skips agreed across ranks)."""

        def __init__(self, precision: str, strategy):
            super().__init__()
            self.precision = precision
            self._strategy = strategy
            self._autocast = PRECISIONS[precision][1]

        def forward_context(self):
            if self._autocast is None:
                return contextlib.nullcontext()
            device = self._strategy.root_device.type
            return torch.autocast(device, dtype=self._autocast)

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
            self._after_closure(model, optimizer)
            skip = model.automatic_optimization and closure_result is None
            if not skip:
                self._strategy.engine.step()
            return closure_result

        def clip_grad_by_norm(self, optimizer, clip_val) -> None:
            self._strategy.engine.clip_grad_norm_(float(clip_val))

        def clip_grad_by_value(self, optimizer, clip_val) -> None:
            self._strategy.engine.clip_grad_value_(float(clip_val))

    return ZeroPrecision


def make_strategy(root: str):
    """The ZeRO strategy class for `root` ("lightning.pytorch" or "pytorch_lightning").
    Only its strategies module is needed now: this may run while the framework is still
    being imported; the rest is looked up at setup()."""
    DDPStrategy = importlib.import_module(f"{root}.strategies").DDPStrategy
    precision_class: list[type] = []

    class ZeroStrategy(DDPStrategy):
        """ZeRO stages 1-3 over `ZeroEngine`. `ZeroStrategy(stage=3, gradient_clipping=0,
        ...)` takes any ZeroConfig field, or `config=ZeroConfig(...)`."""

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
            **zero_options: Any,
        ):
            self._zero_base = zero_config_from(stage, config, zero_options)  # validates early
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

        def _precision_flag(self) -> str:
            plugin = self.precision_plugin
            flag = str(getattr(plugin, "precision", "32-true"))
            if flag not in PRECISIONS:
                raise ValueError(
                    f"precision={flag!r} is not supported by the ZeRO strategy; use one of "
                    f"{sorted(PRECISIONS)}."
                )
            return flag

        def setup(self, trainer) -> None:
            assert self.accelerator is not None
            self.accelerator.setup(trainer)
            flag = self._precision_flag()
            compute = compute_dtype_for(flag, self._zero_base, "Trainer")
            self.engine_config = ZeroConfig.from_dict(
                {**vars(self._zero_base), "compute_dtype": compute}
            )
            if not precision_class:
                precision_class.append(make_precision(root))
            self.precision_plugin = precision_class[0](flag, self)
            model = self.lightning_module
            existing = getattr(model, "_zero_engine", None)
            if trainer.state.fn == "fit" and self._layer_sync and existing is None:
                self.model = self._layer_sync.apply(self.model)  # sync_batchnorm=True
                model = self.lightning_module
            self.model_to_device()
            if existing is not None:
                # The module was sharded by an earlier fit/validate: its parameters live in
                # that engine. Evaluation reuses it; a second fit would need the new
                # optimizer re-pointed at shards that no longer match model.parameters().
                if trainer.state.fn == "fit":
                    raise RuntimeError(
                        "This LightningModule was already sharded by a ZeRO strategy run; "
                        "fit it once per instance (resume with fit(ckpt_path=...) on a new "
                        "instance) or evaluate it with validate/test/predict."
                    )
                self.engine = existing
                self.model = model
                return
            if trainer.state.fn == "fit":  # TrainerFn is a str enum
                self.setup_optimizers(trainer)
                if len(self.optimizers) != 1:
                    raise RuntimeError(
                        f"The ZeRO strategy shards one optimizer, but configure_optimizers "
                        f"returned {len(self.optimizers)}. Put all parameters in one optimizer "
                        "with param groups, or use strategy='ddp' for multi-optimizer training."
                    )
                optimizer = self.optimizers[0]
            else:
                # Evaluation only: the engine still owns (and at stage 3 gathers) the
                # parameters; a learning-rate-0 SGD stands in for the optimizer.
                optimizer = torch.optim.SGD(
                    [p for p in model.parameters() if p.requires_grad] or list(model.parameters()),
                    lr=0.0,
                )
            self.engine = ZeroEngine(model, optimizer, self.engine_config, device=self.root_device)
            model._zero_engine = self.engine
            self.model = model

        def model_to_device(self) -> None:
            """Buffers only: the engine copies each unit's parameters onto the device as it
            shards them, so the whole model never sits on one device at once."""
            place_buffers(self.model, self.root_device)

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
            """configure_model() runs here: modules are built on the meta device and the
            engine materializes only this rank's shard, one unit at a time."""
            with init_on_meta():
                yield

        @contextlib.contextmanager
        def block_backward_sync(self) -> Iterator[None]:
            with self.engine.no_sync() if self.engine is not None else contextlib.nullcontext():
                yield

        def _around_forward(self, name: str, *args, **kwargs):
            """The user's step runs the model through submodules, not the root's forward:
            run the engine's forward bookkeeping around it (buffer broadcast, an outside
            zero_grad), as DDP's forward redirection does."""
            if self.engine is None:
                return getattr(super(), name)(*args, **kwargs)
            self.engine.before_forward()
            try:
                return getattr(super(), name)(*args, **kwargs)
            finally:
                self.engine.after_forward()

        def training_step(self, *args, **kwargs):
            return self._around_forward("training_step", *args, **kwargs)

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

        @property
        def lightning_restore_optimizer(self) -> bool:
            return False  # the engine restores its own sharded optimizer state

        def lightning_module_state_dict(self) -> dict[str, Any]:
            return {}  # the parameters live in the engine's sharded files

        def optimizer_state(self, optimizer) -> dict[str, Any]:
            return {}

        def save_checkpoint(
            self, checkpoint: dict[str, Any], filepath, storage_options=None
        ) -> None:
            if storage_options is not None:
                raise TypeError(
                    "The ZeRO strategy writes its own sharded directory; storage_options are "
                    "not supported. Drop them or use a CheckpointIO with strategy='ddp'."
                )
            client = {
                k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")
            }
            self.engine.save_checkpoint(str(filepath), client_state=to_weights_only(client))

        def load_checkpoint(
            self, checkpoint_path, weights_only: bool | None = None
        ) -> dict[str, Any]:
            # Evaluation runs hold a stand-in optimizer: read the model alone.
            fitting = self.lightning_module.trainer.state.fn == "fit"
            client = self.engine.load_checkpoint(str(checkpoint_path), fitting) or {}
            client.setdefault("state_dict", {})
            return client

        def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
            pass  # loaded by load_checkpoint, sharded

        def load_optimizer_state_dict(self, checkpoint) -> None:
            pass

        def teardown(self) -> None:
            """DDP's teardown without moving the module and optimizer state to the CPU: on
            CUDA that would re-allocate every parameter away from the engine's buffers
            (which later validate/test calls reuse)."""
            if self.engine is not None:
                self.engine.wait_for_parameters()
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
        patch_model_summary_callback(root)
        _CLASSES[root] = cls
    return _CLASSES[root]


def explain_unknown_strategy(error: ValueError, registry, name: object) -> ValueError:
    """Lightning's message for a mistyped name shows a few examples; ours lists every
    registered name and the closest ones."""
    import difflib

    names = sorted(registry)
    close = difflib.get_close_matches(str(name), names, n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(f"{error}\nRegistered strategy names: {', '.join(names)}.{hint}")


def improve_name_errors(connector_cls, registry) -> None:
    """Wrap a connector's __init__ so an unknown strategy name lists the registered ones."""
    if getattr(connector_cls, "_zero_strategy_wrapped", False):
        return
    original = connector_cls.__init__

    def __init__(self, *args, **kwargs):
        try:
            original(self, *args, **kwargs)
        except ValueError as e:
            name = kwargs.get("strategy")
            if "invalid strategy name" in str(e) and isinstance(name, str):
                raise explain_unknown_strategy(e, registry, name) from e
            raise

    connector_cls.__init__ = __init__
    connector_cls._zero_strategy_wrapped = True


def __getattr__(name: str):
    """`from zero_strategy.integrations.lightning import ZeroStrategy`: the class for
    `lightning.pytorch` (use `register("pytorch_lightning")` for the other package)."""
    if name == "ZeroStrategy":
        return register("lightning.pytorch")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
