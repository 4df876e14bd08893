"""Fabric: `Fabric(strategy="zero3")`, an adapter over `ZeroEngine`.

`fabric.setup(model, optimizer)` hands both to a `ZeroEngine`; `fabric.backward`,
`clip_gradients`, the optimizer step, `no_backward_sync`, `save` and `load` go through it.
Checkpoints are the engine's sharded directories; the other entries of the state dict are
saved beside them, loadable with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from torch import nn

from zero_strategy import ZeroConfig, ZeroEngine, init_on_meta
from zero_strategy.checkpoint.consolidate import iter_tensors
from zero_strategy.checkpoint.load import client_state_of
from zero_strategy.checkpoint.one_file import split_one_file
from zero_strategy.checkpoint.safe_load import safe_torch_load
from zero_strategy.comm.shutdown import destroy_default_group_at_exit
from zero_strategy.tensor_parallel import tensor_parallel_mesh

from .client_state import client_state
from .devices import place_buffers, require_cpu_or_cuda
from .pairing import model_of, one_optimizer_message, stand_in_optimizer
from .private_api import backward_sync_control_base, set_backward_sync_control
from .strategy_config import (
    config_for_precision,
    register_zero_names,
    zero_config_from,
)
from .whole_checkpoint import check_state_dict_type


class _EngineSyncControl(backward_sync_control_base()):
    def __init__(self, strategy: ZeroFabricStrategy):
        self.strategy = strategy

    def no_backward_sync(self, module: nn.Module, enabled: bool):
        engine = self.strategy.engine
        if not enabled or engine is None:
            return contextlib.nullcontext()
        return engine.no_sync()


class ZeroFabricStrategy(DDPStrategy):
    """ZeRO stages 1-3 for Fabric; takes any ZeroConfig field, or `config=ZeroConfig(...)`.

    Tensor parallelism (`tensor_parallel_size=N`): as with Fabric's ModelParallelStrategy,
    `parallelize_fn(module, device_mesh)` applies the plan on the mesh's
    "tensor_parallel" dimension in `fabric.setup(model)`; ZeRO shards over
    "data_parallel". Build the optimizer after that, over the parallelized parameters."""

    def __init__(
        self,
        stage: int | None = None,
        config: ZeroConfig | Mapping | None = None,
        parallelize_fn: Callable[[nn.Module, Any], nn.Module] | None = None,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision=None,
        process_group_backend: str | None = None,
        start_method: str = "popen",
        state_dict_type: str = "sharded",
        pretrained: str | os.PathLike | None = None,
        **zero_options: Any,
    ):
        self._zero_base = zero_config_from(stage, config, zero_options)
        # "full": fabric.save writes one file, as FSDPStrategy(state_dict_type="full").
        self.state_dict_type = check_state_dict_type(state_dict_type, "ZeroFabricStrategy")
        # Safetensors weights read into the model when it is sharded (each rank its ranges).
        self.pretrained = pretrained
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            start_method=start_method,
        )
        self._parallelize_fn = parallelize_fn
        self._device_mesh = None
        self.engine: ZeroEngine | None = None
        self._for_evaluation = False  # sharded with a stand-in optimizer (save/load first)
        set_backward_sync_control(self, _EngineSyncControl(self))

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        register_zero_names(cls, strategy_registry)

    def setup_environment(self) -> None:
        require_cpu_or_cuda(self.root_device, "Fabric")
        super().setup_environment()
        destroy_default_group_at_exit()  # a gloo group alive at exit can abort
        self._device_mesh = tensor_parallel_mesh(
            self._zero_base.tensor_parallel_size, self.world_size, self.root_device
        )
        if self._device_mesh is not None and self._parallelize_fn is None:
            raise ValueError(
                f"tensor_parallel_size={self._zero_base.tensor_parallel_size} needs "
                "parallelize_fn=<a function (module, device_mesh) -> module applying the plan "
                "on device_mesh['tensor_parallel']>, as ModelParallelStrategy takes."
            )

    @property
    def device_mesh(self):
        """The (data_parallel, tensor_parallel) mesh, with tensor_parallel_size > 1."""
        return self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Tensor-parallel ranks read the same batches."""
        if self._device_mesh is None:
            return super().distributed_sampler_kwargs
        data = self._device_mesh["data_parallel"]
        return {"num_replicas": data.size(), "rank": data.get_local_rank()}

    def _config(self) -> ZeroConfig:
        """The engine's compute dtype from Fabric's precision flag. Autocast ("bf16-mixed")
        and input casting stay with Fabric's own precision plugin; "16-mixed" becomes fp16
        compute with the engine's loss scaling (the engine runs backward and the step)."""
        return config_for_precision(self.precision, self._zero_base, "Fabric")[1]

    def module_init_context(self, empty_init: bool | None = None):
        """`fabric.init_module()`: never the whole model on the device. `empty_init=True`
        builds it on the meta device and the engine materialises each rank's shard, unit
        by unit (the module's `_init_weights` or `reset_parameters` run there); otherwise
        it is built and initialised in CPU memory and the engine copies one unit at a time
        to the device. (The DDP base would build it whole on the device.)"""
        stack = contextlib.ExitStack()
        stack.enter_context(self.precision.module_init_context())
        if empty_init:
            stack.enter_context(init_on_meta())
        return stack

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list, scheduler=None):
        """Several optimizers (over disjoint parameters, a GAN's) are each sharded."""
        if self._device_mesh is not None:
            raise RuntimeError(
                "With tensor parallelism the plan replaces the model's parameters, so an "
                "optimizer built before it holds the old ones. Set up the model first, then "
                "build the optimizer: model = fabric.setup(model); optimizer = "
                "fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))."
            )
        self.engine = ZeroEngine(module, list(optimizers), self._config(), device=self.root_device)
        self._for_evaluation = False
        self._load_pretrained()
        return module, optimizers, scheduler

    def _load_pretrained(self) -> None:
        if self.pretrained is not None:
            self.engine.load_pretrained(self.pretrained)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """The model first and its optimizer later, the order Fabric recommends for FSDP:
        the module stays whole until `setup_optimizers` hands over its optimizer, then is
        sharded in place. A module that runs before getting one (a frozen reference model,
        an evaluation) is moved to the device whole, replicated as under DDP; `fabric.load`
        into it shards it for evaluation."""
        if self._device_mesh is not None:
            module = self._parallelize_fn(module, self._device_mesh)
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"parallelize_fn must return the nn.Module, got {type(module).__name__}."
                )
        if any(p.is_meta for p in module.parameters()):
            raise RuntimeError(
                "This model was built on the meta device (fabric.init_module(empty_init=True)"
                "). Set it up together with its optimizer, model, optimizer = fabric.setup("
                "model, optimizer), so that each rank materialises only its own shard; the "
                "optimizer may be created over the meta parameters."
            )
        self._pending.append(module)
        handle: list = []

        def place_if_unsharded(mod, args):
            handle.pop().remove()
            if mod in self._pending:
                mod.to(self.root_device)

        handle.append(module.register_forward_pre_hook(place_if_unsharded))
        return module

    @property
    def _pending(self) -> list[nn.Module]:
        if not hasattr(self, "_pending_modules"):
            self._pending_modules: list[nn.Module] = []
        return self._pending_modules

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.engine is not None and self._for_evaluation:
            # Sharded for a save or load before its optimizer came: shard it again with it.
            self._pending.append(self.engine.release_module())
            self.engine = None
        if self.engine is not None:
            raise RuntimeError(
                one_optimizer_message(
                    "The ZeRO strategy",
                    "it has already sharded a model (with its optimizer, or for evaluation "
                    "by fabric.load)",
                    "set up the optimizer before fabric.load",
                )
            )
        owner = model_of(optimizer, self._pending)
        if owner is None:
            raise RuntimeError(
                "fabric.setup_optimizers() needs its model first: call fabric.setup_module("
                "model) before it (the optimizer over that model's parameters), or "
                "fabric.setup(model, optimizer)."
            )
        self._shard(owner, optimizer)
        return optimizer

    def _shard(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, for_evaluation: bool = False
    ) -> None:
        self.engine = ZeroEngine(
            module,
            optimizer,
            self._config(),
            device=self.root_device,
            device_mesh=self._device_mesh,
        )
        self._for_evaluation = for_evaluation
        self._pending.remove(module)
        self._load_pretrained()

    def _shard_for_evaluation(self, state: Any) -> None:
        """A model set up without an optimizer, saved or loaded: shard it with a stand-in
        optimizer (its own arrives later through `setup_optimizers`, or never)."""
        if self.engine is not None:
            return
        values = state.values() if isinstance(state, Mapping) else [state]
        for module in values:
            if isinstance(module, nn.Module) and module in self._pending:
                self._shard(module, stand_in_optimizer(module), for_evaluation=True)
                return

    def _never_set_up(self, state: Any) -> nn.Module | None:
        """The module in `state` if the engine does not shard it: one this strategy never
        saw (not set up with Fabric), or one set up without an optimizer while the engine
        shards another. Either is whole on every rank, so it is saved and loaded whole,
        as under DDP. (A module set up without an optimizer before any is sharded is
        sharded for evaluation instead: `_shard_for_evaluation`.)"""
        values = state.values() if isinstance(state, Mapping) else [state]
        modules = [m for m in values if isinstance(m, nn.Module)]
        sharded = self.engine.module if self.engine is not None else None
        if not modules or any(m is sharded for m in modules):
            return None
        if self.engine is None and any(m in self._pending for m in modules):
            return None
        return modules[0]

    def _require_engine(self, call: str) -> ZeroEngine:
        if self.engine is None:
            raise RuntimeError(
                f"{call} before the model was sharded: give its optimizer to "
                "fabric.setup_optimizers() (or use fabric.setup(model, optimizer))."
            )
        return self.engine

    def module_to_device(self, module: nn.Module) -> None:
        place_buffers(module, self.root_device)  # the engine places the parameters

    def teardown(self) -> None:
        """The engine's process groups go with the strategy."""
        if self.engine is not None:
            self.engine.close()
        super().teardown()

    def backward(self, tensor: torch.Tensor, module, *args: Any, **kwargs: Any) -> None:
        self._require_engine("fabric.backward()").backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        return self.engine.step(optimizer)

    def clip_gradients_norm(
        self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True
    ):
        if norm_type != 2.0:
            raise ValueError("The ZeRO strategy clips by the global L2 norm only (norm_type=2).")
        engine = self._require_engine("fabric.clip_gradients()")
        norm = engine.clip_grad_norm_(float(max_norm), optimizer)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total gradient norm is {norm}; set error_if_nonfinite=False to skip."
            )
        return norm

    def clip_gradients_value(self, module, optimizer, clip_val) -> None:
        self._require_engine("fabric.clip_gradients()").clip_grad_value_(float(clip_val), optimizer)

    def get_optimizer_state(self, optimizer) -> dict[str, Any]:
        """torch's `state_dict()` of `optimizer` unsharded, on rank 0 (empty elsewhere),
        as Fabric's FSDP strategy hands a full state. Collective. Before the model is
        sharded, the optimizer's own (it holds the whole state then)."""
        if self.engine is None:
            return super().get_optimizer_state(optimizer)
        return self.engine.full_optimizer_state_dict(optimizer)

    def save_checkpoint(
        self, path, state: dict[str, Any], storage_options=None, filter=None
    ) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError(
                "The ZeRO strategy writes sharded directories: storage_options and filter are not supported."
            )
        path = self.broadcast(str(path), src=0)  # rank 0's, as Fabric's FSDP strategy
        client = client_state(state, drop_types=(nn.Module, torch.optim.Optimizer))
        plain = self._never_set_up(state)
        if plain is not None:
            full = self.state_dict_type == "full"
            _save_unsharded(plain, state, path, client, self._config(), self.root_device, full)
            return
        self._shard_for_evaluation(state)
        engine = self._require_engine("fabric.save()")
        if self.state_dict_type == "full":
            keys = _saved_under(state, engine)
            engine.save_checkpoint(str(path), client_state=client, one_file=True, keys=keys)
            return
        engine.save_checkpoint(str(path), client_state=client)

    def load_checkpoint(
        self, path, state=None, strict: bool = True, weights_only=None
    ) -> dict[str, Any]:
        if isinstance(state, nn.Module) and Path(path).is_file():
            # fabric.load_raw(path, model): a plain state dict (torch.save or safetensors),
            # loaded through the module's load_state_dict, which reaches the shards.
            state.load_state_dict(read_state_dict(Path(path)), strict=strict)
            return {}
        if isinstance(state, (nn.Module, torch.optim.Optimizer)):
            state = {"state": state}
        # A state without the optimizer (evaluation, a new optimizer) reads the model alone.
        with_optimizer = not state or any(
            isinstance(v, torch.optim.Optimizer) for v in state.values()
        )
        plain = self._never_set_up(state or {})
        if plain is not None and Path(path).is_file():  # a one-file checkpoint, read whole
            weights, client = split_one_file(path)
            plain.load_state_dict(weights, strict=strict)
            return _restore_client(path, state, client, strict)
        if plain is not None:  # a module Fabric never set up: the full model, as DDP loads
            plain.load_state_dict(dict(iter_tensors(path)), strict=strict)
            return _restore_client(path, state, client_state_of(path), strict)
        self._shard_for_evaluation(state or {})
        client = self._require_engine("fabric.load()").load_checkpoint(str(path), with_optimizer)
        return _restore_client(path, state, client, strict)


def _saved_under(state: dict[str, Any], engine: ZeroEngine) -> dict[str, Any]:
    """Where a one-file checkpoint puts the model and each of the engine's optimizers:
    under the names `state` gives them, as Fabric's FSDP full checkpoint does."""
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    if len(modules) != 1:
        raise ValueError(
            f"fabric.save with state_dict_type='full' writes one model, but the state holds "
            f"{len(modules)} modules ({modules}). Save one module per file, or use 'sharded'."
        )
    name_of = {id(v): k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    return {"model": modules[0], "optimizers": [name_of.get(id(o)) for o in engine.optimizers]}


def _restore_client(path, state: dict | None, client: dict | None, strict: bool) -> dict:
    """Fill `state`'s non-model entries from the saved client state; returns the rest."""
    client = client or {}
    if not state:
        return client
    for name in list(state):
        if isinstance(state[name], (nn.Module, torch.optim.Optimizer)):
            continue  # restored by the engine (or loaded whole)
        if name in client:
            state[name] = client.pop(name)
        elif strict:
            raise KeyError(
                f"'{name}' is not in the checkpoint at {path}; pass strict=False to skip it."
            )
    return client


def _save_unsharded(module: nn.Module, state, path, client, config, device, full: bool) -> None:
    """`fabric.save` of a module never set up: the same checkpoint a set-up one writes
    (the sharded directory, or with `full` the one file; either loads at any world size),
    from a throwaway engine over a copy of it."""
    copy = deepcopy(module)
    engine = ZeroEngine(copy, stand_in_optimizer(copy), config, device=device)
    try:
        if full:  # the module's entry in `state` names the model in the file
            keys = {"model": next(k for k, v in state.items() if v is module), "optimizers": []}
            engine.save_checkpoint(str(path), client_state=client, one_file=True, keys=keys)
        else:
            engine.save_checkpoint(str(path), client_state=client)
    finally:
        engine.close()


def register() -> None:
    if "zero3" not in STRATEGY_REGISTRY:
        ZeroFabricStrategy.register_strategies(STRATEGY_REGISTRY)


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A full model state dict from safetensors or a torch file (weights only, no pickle)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = safe_torch_load(path)
    return state.get("state_dict", state) if isinstance(state, Mapping) else state


register()  # importing this module imports Fabric's registry: the names come with it
