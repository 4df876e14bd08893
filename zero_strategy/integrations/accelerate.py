"""Accelerate: ZeRO under `accelerate launch`, with one changed line in the training script.

    accelerator = ZeroAccelerator()   # was: Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

Accelerate has no place for a third-party sharding plugin: its config file rejects
unknown keys, `DistributedType` is a closed enum, and the `Accelerator` constructor's
plugin arguments are typed. So the script swaps the class, and the ZeRO settings come
from a `ZeroPlugin`: its arguments, else the `ZERO_STRATEGY_*` environment variables that
`accelerate launch` copies into every process (`ZERO_STRATEGY_STAGE`,
`ZERO_STRATEGY_EXPERT_PARALLEL_SIZE`, `ZERO_STRATEGY_TENSOR_PARALLEL_SIZE`, and
`ZERO_STRATEGY_CONFIG_FILE` naming a YAML or JSON file of `ZeroConfig` fields, or a
DeepSpeed `ds_config.json`). Launch as
Accelerate's plain multi-process type (`--multi_gpu`, with `--cpu` or `cpu=True` on CPU),
or with the DeepSpeed ZeRO config `accelerate config` wrote: its stage and clipping are
translated (`accelerate_env`), and Accelerate does not also set up DeepSpeed.

The model is never wrapped: the engine shards it in place, so `unwrap_model` returns the
user's module and `model(...)` is the user's forward. `backward`, the prepared optimizer's
`step`/`zero_grad`, `accumulate`/`no_sync`, `clip_grad_norm_`/`clip_grad_value_` go
through the engine; `save_state`/`load_state` write and read the engine's sharded
checkpoint beside Accelerate's own files (schedulers, samplers, RNG); `get_state_dict` and
`save_model` consolidate the model on the main process, unit by unit.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import nn

from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.deepspeed_config import from_deepspeed_config, looks_like_deepspeed_config
from zero_strategy.tensor_parallel import tensor_parallel_mesh

from .accelerate_env import take_deepspeed_env
from .devices import place_buffers, require_cpu_or_cuda
from .engine_of import attach, engine_of
from .joint_models import JointModels
from .pairing import models_trained_by, one_optimizer_message
from .private_api import mark_prepared
from .replica_grads import ReplicatedModels
from .whole_checkpoint import check_state_dict_type

ENV_STAGE = "ZERO_STRATEGY_STAGE"
ENV_EXPERT_PARALLEL = "ZERO_STRATEGY_EXPERT_PARALLEL_SIZE"
ENV_TENSOR_PARALLEL = "ZERO_STRATEGY_TENSOR_PARALLEL_SIZE"
ENV_CONFIG_FILE = "ZERO_STRATEGY_CONFIG_FILE"
CHECKPOINT_DIR = "zero_model"  # inside save_state's folder: the engine's sharded checkpoint
CHECKPOINT_FILE = "zero_model.pt"  # or, with state_dict_type="full", the one file
OPTIMIZER_MARKER = {"zero_strategy": "sharded; the state is in the zero_model checkpoint"}

# Accelerate's mixed_precision -> the engine's compute dtype. "bf16" keeps fp32
# parameters under Accelerate's autocast (its own meaning of the flag); "fp16" computes in
# fp16 with fp32 masters and the engine's dynamic loss scaling, as DeepSpeed does.
COMPUTE_DTYPES = {"no": "fp32", "bf16": "fp32", "fp16": "fp16"}


@dataclass
class ZeroPlugin:
    """The ZeRO settings of a `ZeroAccelerator`.

    Fields are read in this order, later ones winning: Accelerate's DeepSpeed settings
    (`ACCELERATE_USE_DEEPSPEED` and the `ACCELERATE_DEEPSPEED_*` variables `accelerate
    launch` exports for a DeepSpeed config; see `accelerate_env`), the YAML/JSON file
    (`config_file`, else `$ZERO_STRATEGY_CONFIG_FILE`), `$ZERO_STRATEGY_STAGE` and
    `$ZERO_STRATEGY_EXPERT_PARALLEL_SIZE`, then `stage` and `options` (any `ZeroConfig`
    field) given here."""

    stage: int | None = None
    config_file: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    # "full": save_state writes the model and optimizer state as one file (CHECKPOINT_FILE,
    # {"model", "optimizer"} as FSDP's full state dicts hold them) instead of a directory.
    state_dict_type: str = "sharded"
    # Safetensors weights (a file, a directory, a Hub-style sharded set) read into the
    # model as prepare() shards it: each rank reads only its own ranges.
    pretrained: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        check_state_dict_type(self.state_dict_type, "ZeroPlugin")

    def resolve(self, mixed_precision: str, base: Mapping[str, Any] | None = None) -> ZeroConfig:
        values: dict[str, Any] = {"stage": 3, **(base or {})}
        config_file = self.config_file or os.environ.get(ENV_CONFIG_FILE)
        if config_file:
            values.update(_read_config_file(config_file))
        if os.environ.get(ENV_STAGE):
            values["stage"] = _int_from_env(ENV_STAGE, "a stage (0, 1, 2 or 3)")
        if os.environ.get(ENV_EXPERT_PARALLEL):
            values["expert_parallel_size"] = _int_from_env(ENV_EXPERT_PARALLEL, "a number of ranks")
        if os.environ.get(ENV_TENSOR_PARALLEL):
            values["tensor_parallel_size"] = _int_from_env(ENV_TENSOR_PARALLEL, "a number of ranks")
        values.update(self.options)
        if self.stage is not None:
            values["stage"] = self.stage
        if "compute_dtype" not in values:
            if mixed_precision not in COMPUTE_DTYPES:
                raise ValueError(
                    f"mixed_precision={mixed_precision!r} is not supported with ZeRO; use one of "
                    f"{sorted(COMPUTE_DTYPES)}."
                )
            values["compute_dtype"] = COMPUTE_DTYPES[mixed_precision]
        return ZeroConfig.from_dict(values)


def _read_config_file(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"ZeRO config file {path!r} (from {ENV_CONFIG_FILE} or ZeroPlugin.config_file) "
            "does not exist. Point it at a YAML or JSON file of ZeroConfig fields."
        )
    text = file.read_text()
    if file.suffix == ".json":
        values = json.loads(text)
    else:
        import yaml  # a dependency of accelerate

        values = yaml.safe_load(text) or {}
    if not isinstance(values, Mapping):
        raise ValueError(f"{path} must hold a mapping of ZeroConfig fields, got {type(values)}.")
    if looks_like_deepspeed_config(values):  # a ds_config.json brought along
        translated, defaults = vars(from_deepspeed_config(values)), vars(ZeroConfig())
        return {k: v for k, v in translated.items() if v != defaults[k]}
    return dict(values)


def _int_from_env(name: str, what: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r} is not {what}; set an integer.") from None


class ZeroOptimizer(AcceleratedOptimizer):
    """What `prepare` returns for a sharded optimizer: `step` is the engine's (global-norm
    clipping, fp16 skips) and, like Accelerate's wrapper, runs only when gradients are
    synchronised. `state_dict()` is a marker: the state lives in the sharded checkpoint."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine: ZeroEngine):
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.engine = engine
        self._skipped = False

    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError(
                "The ZeRO optimizer steps without a closure; compute the loss, call "
                "accelerator.backward(loss), then optimizer.step()."
            )
        if self.gradient_state.sync_gradients:
            self._skipped = not self.engine.step(self._own())

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped for an fp16 overflow (on every rank alike)."""
        return self._skipped

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self.gradient_state.sync_gradients:
            to_none = True if set_to_none is None else set_to_none  # torch's default
            self.engine.zero_grad(set_to_none=to_none, optimizer=self._own())

    def _own(self) -> torch.optim.Optimizer | None:
        """The optimizer to step or clear: this one where the engine has several (a
        GAN's, in one model), or None (the engine's one)."""
        return self.optimizer if len(self.engine.optimizers) > 1 else None

    def state_dict(self) -> dict[str, Any]:
        return dict(OPTIMIZER_MARKER)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if dict(state_dict) == OPTIMIZER_MARKER:
            return  # restored with the model by load_state
        raise ValueError(
            "A sharded ZeRO optimizer cannot load a plain optimizer state dict; restore it "
            "with accelerator.load_state(dir) from a directory written by save_state."
        )


class ZeroAccelerator(Accelerator):
    """`Accelerator` whose `prepare` shards a model and its optimizers (one, or several: a
    GAN's in one module, or two over the same weights) with a `ZeroEngine`.
    A model prepared without an optimizer (a frozen reference model) is prepared as
    Accelerate prepares one for evaluation: replicated, not sharded.

    Launched with an `accelerate config` for DeepSpeed ZeRO, its stage and clipping are the
    base of the ZeroConfig (`accelerate_env`); `zero_plugin`'s fields and the
    `ZERO_STRATEGY_*` variables win over them, as this class's own arguments
    (`mixed_precision`, `gradient_accumulation_steps`) win over Accelerate's variables."""

    def __init__(self, *args: Any, zero_plugin: ZeroPlugin | None = None, **kwargs: Any):
        deepspeed_env = take_deepspeed_env()  # before Accelerate reads ACCELERATE_USE_DEEPSPEED
        super().__init__(*args, **kwargs)
        if self.distributed_type in (
            DistributedType.DEEPSPEED,
            DistributedType.FSDP,
            DistributedType.MEGATRON_LM,
            DistributedType.XLA,
        ):
            raise ValueError(
                f"ZeroAccelerator shards the model itself, but Accelerate is configured for "
                f"{self.distributed_type.value}. Launch with the plain multi-process type "
                "(`accelerate launch --multi_gpu ...`, no DeepSpeed/FSDP section in the config)."
            )
        require_cpu_or_cuda(self.device, "Accelerator")
        self.zero_plugin = zero_plugin or ZeroPlugin()
        self.zero_config = self.zero_plugin.resolve(self._precision_as_run(), deepspeed_env)
        # Tensor parallelism: the (dp_shard, tp) mesh, named as Accelerate names its own;
        # apply the plan on accelerator.device_mesh["tp"] before building the optimizer.
        self.device_mesh = tensor_parallel_mesh(
            self.zero_config.tensor_parallel_size,
            self.num_processes,
            self.device,
            names=("dp_shard", "tp"),
        )
        self.engine: ZeroEngine | None = None
        self._run_only: list[ZeroEngine] = []  # frozen models sharded for evaluation
        self._unpaired_models: list[nn.Module] = []
        # Trainable models prepared without an optimizer: replicated, averaged as by DDP.
        self._replicas = ReplicatedModels()
        self._unsharded_params: set[int] = set()  # id() of lone optimizers' parameters
        self._saving_state = False
        self._save_hook = self.register_save_state_pre_hook(self._save_engine_checkpoint)
        self._load_hook = self.register_load_state_pre_hook(self._load_engine_checkpoint)

    @property
    def torch_device_mesh(self):
        """With tensor parallelism, the mesh Accelerate's data loaders read: batches are
        split over the data-parallel ranks, the same at every tensor-parallel position."""
        return self.device_mesh if self.device_mesh is not None else super().torch_device_mesh

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None):
        replaced: dict[int, Any] = {}
        models = [a for a in args if isinstance(a, nn.Module)]
        trained = {
            id(p)
            for a in args
            if isinstance(a, torch.optim.Optimizer)
            for group in a.param_groups
            for p in group["params"]
        }
        for model in models:  # prepared before, e.g. again after free_memory()
            engine = self._engine_of(model)
            if engine in self._run_only and any(id(p) in trained for p in model.parameters()):
                # Sharded for evaluation first (a Trainer's evaluate() before train()):
                # handed back whole, and sharded again with its optimizer below.
                self._run_only.remove(engine)
                engine.release_module()
                attach(self._raw(model), None)
                engine = None
            if engine is not None and engine not in self._run_only:
                self._adopt(engine)
        fresh = [m for m in models if self._engine_of(m) is None]
        optimizers = [
            a
            for a in args
            if isinstance(a, torch.optim.Optimizer) and not isinstance(a, ZeroOptimizer)
        ]
        # The models this call's optimizers train are sharded with them, together (by one
        # engine, however many models and optimizers).
        candidates = fresh + self._unpaired_models
        trained_models: list[nn.Module] = []
        own: list[torch.optim.Optimizer] = []
        for optimizer in optimizers:
            models_of_optimizer = models_trained_by(optimizer, candidates)
            if models_of_optimizer is None:
                self._prepare_unpaired(optimizer, candidates)
                continue
            own.append(optimizer)
            trained_models += [m for m in models_of_optimizer if not _among(m, trained_models)]
        if trained_models:
            trained_models.sort(key=lambda m: next(i for i, c in enumerate(candidates) if c is m))
            prepared, wrapped = self._shard(trained_models, own)
            replaced.update((id(m), p) for m, p in zip(trained_models, prepared))
            replaced.update((id(opt), w) for opt, w in zip(own, wrapped))
            for model in trained_models:
                if model in self._unpaired_models:
                    self._unpaired_models.remove(model)
                    self._replicas.remove(self._raw(model))
        for model in fresh:
            if self._engine_of(model) is None:
                self._unpaired_models.append(model)
                place_buffers(model, self.device)
                replaced[id(model)] = super().prepare_model(model, evaluation_mode=True)
                self._replicas.add(self._raw(model))
        args = tuple(replaced.get(id(a), a) for a in args)
        return super().prepare(*args, device_placement=device_placement)

    def _prepare_unpaired(self, optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> None:
        """An optimizer whose model was not prepared (yet): Accelerate prepares it on
        its own, unsharded, and so does this class, saying so; its model, prepared later,
        is then replicated as under DDP. Refused: one over part of a model being prepared
        (or over several), and one over parameters an engine already shards."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self._engine_for(params) is not None:
            raise ValueError(
                one_optimizer_message(
                    "ZeroAccelerator",
                    "prepare() got a second optimizer over the parameters of the model "
                    "it already shards",
                )
            )
        known = {id(p) for model in models for p in model.parameters()}
        if any(id(p) in known for p in params):
            raise ValueError(
                "ZeroAccelerator.prepare got an optimizer over parameters of a model being "
                "prepared and tensors of no prepared model: the engine shards the models "
                "with the optimizer over their parameters. Pass every model the optimizer "
                "trains to the same prepare() call (several are fine)."
            )
        warnings.warn(
            "ZeroAccelerator.prepare got an optimizer whose model was not prepared before "
            "it or with it: the optimizer is prepared as Accelerate prepares it, unsharded, "
            "and its model, prepared later, is replicated on every rank as under DDP. To "
            "shard them, pass the model and its optimizer to the same prepare() call (or "
            "prepare the model first).",
            stacklevel=3,
        )
        self._unsharded_params.update(id(p) for p in params)

    def _adopt(self, engine: ZeroEngine) -> None:
        if self.engine is None:
            self.engine = engine
        elif self.engine is not engine:
            raise ValueError(self._ONE_MODEL)

    _ONE_MODEL = one_optimizer_message(
        "ZeroAccelerator",
        "this one already shards another model",
        "use a separate ZeroAccelerator per model (or call accelerator.free_memory() between "
        "two trainings)",
    )

    def _shard(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
        """(the modules to hand back, the optimizers to hand back) for the models one
        prepare() call trains and their optimizers: one engine over the model, or over
        several models held together (`JointModels`: a UNet and a text encoder under one
        optimizer, a GAN's two modules with an optimizer each)."""
        if self.engine is not None:
            raise ValueError(self._ONE_MODEL)
        if any(id(p) in self._unsharded_params for m in models for p in m.parameters()):
            raise ValueError(
                "ZeroAccelerator.prepare: an optimizer prepared earlier, on its own and so "
                "unsharded, already holds parameters of this model; sharding the model now "
                "would leave that optimizer stepping tensors the engine owns. Pass the model "
                "and its optimizers to the same prepare() call."
            )
        if len(models) > 1 and self.zero_plugin.pretrained is not None:
            raise ValueError(
                f"ZeroPlugin(pretrained=...) loads one model's weights, and prepare() got "
                f"{len(models)} models trained together "
                f"({', '.join(type(m).__name__ for m in models)}). Load each model's weights "
                "before prepare() (from_pretrained, or load_state_dict)."
            )
        root = models[0] if len(models) == 1 else JointModels(models)
        for model in models:
            place_buffers(model, self.device)
        self.engine = ZeroEngine(
            root, optimizers, self.zero_config, device=self.device, device_mesh=self.device_mesh
        )
        for model in models:
            attach(model, self.engine)
        if self.zero_plugin.pretrained is not None:
            self.engine.load_pretrained(self.zero_plugin.pretrained)
        # Accelerate's autocast and torch.compile, without its DDP wrap or device move.
        prepared = [
            super(ZeroAccelerator, self).prepare_model(
                model, device_placement=False, evaluation_mode=True
            )
            for model in models
        ]
        wrapped = [ZeroOptimizer(optimizer, self.engine) for optimizer in optimizers]
        for each in wrapped:
            mark_prepared(each)  # prepare() keeps it, and lists it as Accelerate's own
        return prepared, wrapped

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ):
        """A model prepared for evaluation only (TRL's DPO reference model, a
        distillation teacher) is sharded at stage 3 as the trained one is: each rank holds
        1/N of its parameters, gathered block by block as it runs, and no gradient or
        optimizer state. Anything else as Accelerate's."""
        if not (evaluation_mode and self.zero_config.stage == 3):
            return super().prepare_model(model, device_placement, evaluation_mode)
        if self._engine_of(model) is None:
            place_buffers(model, self.device)
            engine = ZeroEngine(
                model, None, self.zero_config, device=self.device, device_mesh=self.device_mesh
            )
            attach(model, engine)
            self._run_only.append(engine)
        return super().prepare_model(model, device_placement=False, evaluation_mode=True)

    def end_training(self) -> None:
        """As Accelerate's (trackers finished, the default group destroyed), with the
        engines' work finished and their groups destroyed first, so that the process exits
        cleanly."""
        for engine in [self.engine, *self._run_only]:
            if engine is not None:
                engine.close()
        super().end_training()

    def free_memory(self, *objects: Any):
        """As Accelerate's, and the next prepare() may shard a new model (a new Trainer
        trial); the model sharded before keeps its engine, whose process groups are
        destroyed here and re-created when it is used again."""
        if self.engine is not None:
            self.engine.close()
        self.engine = None
        self._unpaired_models = []
        self._replicas = ReplicatedModels()
        self._unsharded_params = set()
        return super().free_memory(*objects)

    def _raw(self, model: nn.Module) -> nn.Module:
        """The user's module under Accelerate's wrappers (compile, autocast), ungathered."""
        return super().unwrap_model(model, keep_torch_compile=False)

    def _engine_of(self, model: nn.Module) -> ZeroEngine | None:
        return engine_of(self._raw(model))

    def _precision_as_run(self) -> str:
        """The mixed precision Accelerate applies on this device. It runs "fp16" as fp32
        where it has no fp16 autocast and scaler (the CPU): a DDP user's model keeps fp32
        weights there and takes fp32 inputs. The engine follows, and says so, instead of
        computing in fp16 weights that fp32 inputs cannot meet."""
        precision = str(self.mixed_precision)
        if precision == "fp16" and not self.native_amp:
            warnings.warn(
                f"Accelerator(mixed_precision='fp16') on {self.device.type}: Accelerate "
                "applies no fp16 there (no autocast, no gradient scaler), and so the ZeRO "
                "engine computes in fp32, as DDP does under Accelerate. For reduced "
                "precision on the CPU use mixed_precision='bf16'; for fp16 weights with fp32 "
                "masters pass ZeroPlugin(options={'compute_dtype': 'fp16'}).",
                stacklevel=3,
            )
            return "no"
        return precision

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The user's module, as Accelerate's; at stage 3 with its full parameters
        gathered (collective), so that reading them after training (a parity check, a
        signature) sees what DDP shows. They stay gathered until the model's next forward
        or step frees them."""
        inner = super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)
        engine = self._engine_of(model)
        if engine is not None and not engine.in_step:  # not mid-step (a loss function's)
            engine.unshard()
        return inner

    # ------------------------------------------------------------------ training
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.engine is None:
            super().backward(loss, **kwargs)
        else:
            self.engine.backward(loss / self.gradient_accumulation_steps, **kwargs)
        self._replicas.after_backward()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return self._sync_choice(model, False) or super().no_sync(model)

    def trigger_sync_in_backward(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """The next backward synchronises, even inside `no_sync()`. The engine's
        models decide at backward already (a backward outside `no_sync()` reduces)."""
        return self._sync_choice(model, True) or Accelerator.trigger_sync_in_backward(model)

    def _sync_choice(
        self, model: nn.Module, sync: bool
    ) -> contextlib.AbstractContextManager[None] | None:
        """Whether the backwards inside reduce, for the engine's model or a replicated
        one; None for a model Accelerate handles itself."""
        engine = self._engine_of(model)
        if engine is not None:
            return engine.synchronised() if sync else engine.no_sync()
        raw = self._raw(model)
        if raw in self._replicas:
            return self._replicas.synchronised(raw) if sync else self._replicas.no_sync(raw)
        return None

    def _engine_for(self, parameters: Iterable[torch.Tensor]) -> ZeroEngine | None:
        if self.engine is None:
            return None
        return self.engine if any(self.engine.manages(p) for p in parameters) else None

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        engine = self._engine_for(parameters)
        if engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if float(norm_type) != 2.0:
            raise ValueError("ZeRO clips by the global L2 norm over all shards: use norm_type=2.")
        return engine.clip_grad_norm_(float(max_norm))

    def clip_grad_value_(self, parameters, clip_value):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        engine = self._engine_for(parameters)
        if engine is None:
            return super().clip_grad_value_(parameters, clip_value)
        engine.clip_grad_value_(float(clip_value))

    # ------------------------------------------------------------------ weights
    def get_state_dict(self, model: nn.Module, unwrap: bool = True):
        """The consolidated model on the main process (in the dtype of the model's own
        parameters), gathered unit by unit; an empty dict elsewhere, which `save_model` and
        `save_pretrained(is_main_process=False)` write nothing from (None would make
        `save_pretrained` call `state_dict()` itself). Collective: call it on every rank."""
        engine = self._engine_of(model)
        if engine is None:
            return super().get_state_dict(model, unwrap)
        if self._saving_state:
            return _ShardedModel()  # save_state writes the sharded checkpoint instead
        # save_on_each_node: every node's local main process writes, so all ranks get it.
        everywhere = bool(self.project_configuration.save_on_each_node)
        state = engine.full_state_dict(rank0_only=not everywhere)
        if not state:
            return {}
        dtype, params = engine.config.compute_torch_dtype, engine.parameter_names()
        state = {
            name: value.to(dtype) if name in params else value for name, value in state.items()
        }
        if isinstance(engine.module, JointModels):  # this model's part, under its own names
            return engine.module.own_state(self._raw(model), state)
        return state

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kw):
        # The engine's hook runs after the user's (which see `weights` aligned with `models`).
        self._save_hook.remove()  # registered again: hooks run in registration order
        self._save_hook = self.register_save_state_pre_hook(self._save_engine_checkpoint)
        self._saving_state = True
        try:
            return super().save_state(output_dir, safe_serialization, **kw)
        finally:
            self._saving_state = False

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kw):
        self._load_hook.remove()  # the engine's after the user's, as for saving
        self._load_hook = self.register_load_state_pre_hook(self._load_engine_checkpoint)
        return super().load_state(input_dir, load_kwargs, **kw)

    def _save_engine_checkpoint(self, models: list, weights: list, output_dir: str) -> None:
        """Runs on every rank inside save_state: the engine writes its sharded checkpoint
        (collective), and Accelerate's own model file is skipped for the sharded model."""
        if self.engine is not None and any(self._engine_of(m) is not None for m in models):
            self.write_engine_checkpoint(output_dir)
        weights[:] = [w for w in weights if not isinstance(w, _ShardedModel)]

    def _load_engine_checkpoint(self, models: list, input_dir: str) -> None:
        kept, loaded = [], []
        for model in models:
            engine = self._engine_of(model)
            if engine is None:
                kept.append(model)
            elif not _among(engine, loaded):  # once for the models it shards together
                engine.load_checkpoint(engine_checkpoint_in(input_dir))
                loaded.append(engine)
        models[:] = kept

    def write_engine_checkpoint(self, output_dir: str) -> None:
        """The engine's model and optimizer state into `output_dir` (collective): the
        sharded directory, or with `state_dict_type="full"` one file holding them under
        "model" and "optimizer" (Accelerate's names)."""
        assert self.engine is not None
        if self.zero_plugin.state_dict_type != "full":
            self.engine.save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR))
            return
        count = len(self.engine.optimizers)
        keys = {
            "model": "model",
            "optimizers": [f"optimizer_{i}" if i else "optimizer" for i in range(count)],
        }
        path = os.path.join(output_dir, CHECKPOINT_FILE)
        self.engine.save_checkpoint(path, client_state={}, one_file=True, keys=keys)


def engine_checkpoint_in(folder: str) -> str:
    """The engine's checkpoint in a save_state (or Trainer checkpoint) folder: the one
    file when there is one, else the sharded directory."""
    whole = os.path.join(folder, CHECKPOINT_FILE)
    return whole if os.path.isfile(whole) else os.path.join(folder, CHECKPOINT_DIR)


class _ShardedModel(dict):
    """What get_state_dict gives save_state for the sharded model: recognised (and
    dropped) by the engine's save hook, whatever other hooks did to the list."""


def _among(item: object, items: list) -> bool:
    """`item` is one of `items` (by identity: modules compare by identity, but engines
    and tensors must not be compared with ==)."""
    return any(item is each for each in items)
