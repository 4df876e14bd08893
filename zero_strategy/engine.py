"""`ZeroEngine`: owns the sharded training state of one model on one rank.

    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3))
    loss = engine.module(batch)   # the user's module, hooks installed; forward unchanged
    engine.backward(loss)         # loss scaling (fp16); reductions overlap backward
    engine.step()                 # wait comms, unscale, global-norm clip, inner step
    engine.zero_grad()

The engine composes the pieces that each own one concern: the layout (`partition`), the
per-unit tensors (`flat_unit`), gradient reduction (`grads`), stage-3 gathering
(`params`), the optimizer re-pointing (`optimizer`), loss scaling (`precision`) and
meta-device materialisation (`init`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import itertools
import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .builder import meta_init
from .checkpoint import sharded as checkpoint
from .checkpoint.pretrained import load_pretrained
from .comm import shutdown
from .comm.topology import ProcessGroups
from .config import ZeroConfig
from .kernels import multi_tensor_sum_squares, reference_sum_squares
from .layout.partition import (
    FROZEN_GROUP,
    Stored,
    UnitLayout,
    bucket_layouts,
    frozen_leftover_modules,
    module_layouts,
    select_unit_modules,
    unique_parameters,
)
from .layout.shard_spec import (
    PlacementFn,
    ShardSpec,
    owner_of,
    placed_modules,
    placed_path_of_names,
    spec_of_owner,
)
from .memory.accounting import held_bytes, memory_report
from .memory.peaks import MemoryPeaks
from .model_view.full_view import FullGrads, FullParameters
from .model_view.generation_sync import keep_generation_in_step
from .model_view.module_state import ModuleStateHooks
from .model_view.replaced_data import adopt_replaced, converted_warning, replaced_slots
from .model_view.routed_zero_grad import route_zero_grad
from .moe.expert_placement import (
    ExpertNames,
    expert_layers,
    expert_parallel_partition,
    expert_placements,
    settle_expert_parallel,
)
from .offload import (
    StagingBuffers,
    agree_on_write_failures,
    free_large_blocks_at_once,
    keeps_stage_3,
    offloads_gradients,
    offloads_masters,
    optimizer_host,
    parameters_host,
    state_store,
    unit_tiers,
)
from .optim import fused_step
from .optim.ema import ShardedEMA
from .optim.landed_norms import LandedNorms
from .optim.loss_scaler import LossScaler
from .optim.optimizer_set import OptimizerSet
from .optim.shard_views import (
    OptimizerView,
    check_host_optimizers,
    check_optimizer,
    group_index_of_params,
    repoint_optimizer,
    user_step_hooks,
    without_user_step_hooks,
)
from .tensor_parallel import (
    broadcast_whole_parameters,
    check_head_counts,
    full_tensor,
    match_local_dtype,
    whole_for_init,
)
from .tensor_parallel import check_parameters as check_tensor_parameters
from .units.flat_unit import FlatUnit, OneResident
from .units.gather import STATE_DICT, GatherManager, in_backward
from .units.grads import GradReducer
from .units.module_hooks import EngineHook
from .units.publish import ParameterPublisher


class ZeroEngine:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        config: ZeroConfig | dict | None = None,
        *,
        device: torch.device | str | None = None,
        param_init_fn: meta_init.InitFn | None = None,
        placement: PlacementFn | None = None,
        device_mesh: Any = None,
    ):
        """`placement(module_path, module)` may return a `ShardSpec` for a module whose
        parameters are sharded over groups other than the whole world (None elsewhere).
        The experts of `zero_strategy.moe.MoE` layers are placed on their
        expert-data-parallel groups whatever it says.

        Several optimizers over disjoint parameter sets (a GAN's) are each sharded, and
        step on their own: `step(optimizer)`, `optimizer.zero_grad()`.

        Tensor parallelism: apply torch's plan (`parallelize_module`) on the tensor
        dimension of a 2-D (data, tensor) `device_mesh` and pass that mesh, or set
        `ZeroConfig.tensor_parallel_size` (contiguous tensor groups). ZeRO then shards over
        the data dimension only (`zero_strategy.tensor_parallel`)."""
        self.config = _coerce_config(config)
        cfg = self.config
        optimizers = _optimizer_list(optimizer, cfg)
        for opt in optimizers:
            check_optimizer(opt, cfg.allow_untested_optimizer)
        self._optimizer_set = OptimizerSet(optimizers)
        if not isinstance(model, nn.Module):
            raise TypeError(f"ZeroEngine needs an nn.Module, got {type(model).__name__}.")
        _settle_expert_parallel(model, self._optimizer_set, cfg.expert_parallel_size)
        params = unique_parameters(model)
        if not params:
            raise ValueError(
                f"{type(model).__name__} has no parameters, so there is nothing to shard or "
                "train. Pass the model that holds the trainable parameters."
            )
        self.device = _resolve_device(params, device)
        self.groups = ProcessGroups(
            self.device,
            cfg.collective_timeout,
            cfg.reduce_scatter_via_all_reduce,
            cfg.all_gather_via_broadcast,
            cfg.tensor_parallel_size,
            device_mesh,
        )
        self._check_tensor_parallel(model, cfg)
        # Dropping the engine (with its module) destroys its groups; so does close().
        self._finalizer = weakref.finalize(self, self.groups.close)
        shutdown.close_at_exit(self)  # still alive when the script ends: close() first
        self._world = self.groups.world.comm  # every rank: control messages, buffers
        # One process has nothing to shard: every parameter and gradient stays in place,
        # as in plain training, whatever stage was asked for (the checkpoints are the same);
        # unless its parameters are offloaded, which stage 3's gathers do unit by unit.
        offloads_params = keeps_stage_3(cfg, self.device)
        self.stage = cfg.stage if self.world_size > 1 or offloads_params else 0
        # The optimizer's side (masters, gradient shards, state): here or in host memory;
        # and stage 3's parameter shards between gathers.
        self._host, self._pin = optimizer_host(cfg, self.device)
        self._shards_host = parameters_host(cfg, self.device, self._host)
        # Where the compute copies this rank steps into live: the device, or stage 3's
        # shards on the host (then the fp32 master is the shard itself, as on the CPU).
        compute_home = self._shards_host if self.stage == 3 else self.device
        # Whether a per-unit tier (parameters', masters', gradients') keeps shards in a
        # file: their memory must leave with them, and the step goes unit by unit.
        self._units_on_disk = (
            cfg.offload_params == "disk"
            or offloads_gradients(cfg, self.stage)
            or offloads_masters(cfg, self._host, compute_home)
        )
        if self._units_on_disk:  # before the shards are made
            free_large_blocks_at_once()
        self.module = model

        group_of = group_index_of_params(self._optimizer_set, [p.param for p in params])
        for p in params:
            if not p.param.requires_grad:
                group_of.pop(id(p.param), None)
        layers = expert_layers(model)
        placed = placed_modules(model, placement, self.world_size)
        placed.update(expert_placements(layers, self.world_size))
        self._expert_names = ExpertNames(layers)
        # Cross-rank agreement first: a rank that raised alone would leave the others
        # waiting in the next collective until the timeout.
        self._check_same_model_on_all_ranks(params, group_of, placed)
        self._warn_unoptimized(params, group_of)
        self._check_sizes(params, group_of)
        for layer in layers.values():  # before materialising: binding picks the experts
            if layer.ep_size > 1:
                partition = expert_parallel_partition(layer.ep_size, self.world_size)
                layer.bind(self.groups.communicator(partition))
        if self.stage == 3 or any(layer.ep_size > 1 for layer in layers.values()):
            keep_generation_in_step(model)  # every forward is a collective

        # Tensor-parallel shards, by every name: checkpointed as blocks of the full tensor.
        self._tensor_sharded = {
            name: p.tensor for p in params if p.tensor and p.tensor.sharded for name in p.names
        }
        layouts = self._layouts(model, params, group_of, placed)
        self.units = [
            FlatUnit(
                lay,
                [model.get_parameter(s.name) for s in lay.slots],
                self.stage,
                self.groups.shard_group(lay.spec),
                self.device,
                cfg.compute_torch_dtype,
                self._host,
                self._pin,
                self._shards_host if self.stage == 3 else None,
            )
            for lay in layouts
        ]
        on_meta = meta_init.has_meta_params(model)
        recomputed: list[str] = []
        if on_meta:
            meta_init.detach_from_meta([p.param for p in params], self.device)
            recomputed = meta_init.detach_meta_buffers(model, self.device, param_init_fn)
        self._materialize(model, on_meta, param_init_fn)
        if on_meta:
            owners = meta_init.buffer_owners(model, recomputed)
            meta_init.run_init(model, owners, param_init_fn)
            meta_init.check_no_meta_buffers(model, recomputed)
        self._sync_buffers()  # as DDP at construction, whatever broadcast_buffers says

        self.optimizers = optimizers
        self.optimizer = optimizers[0]
        self._opt_views: list[OptimizerView] = []
        self._repoint_optimizer()
        self._guards = [o.register_step_pre_hook(self._guard_direct_step) for o in optimizers]
        self._handles = list(self._guards)
        # The fused kernel steps masters on the training device; offloaded, the CPU steps.
        on_device = self._host == self.device
        self._fused = [fused_step.build(o, own_hooks=1) if on_device else None for o in optimizers]
        if not on_device:
            check_host_optimizers(optimizers)
        self._ema = ShardedEMA(self._opt_views, self._optimizer_set.state)
        self._memory = MemoryPeaks(self._held_bytes, self._transient_bytes)
        self._grads = None  # the gradient shards' disk tier, made once the units are final
        # Where the optimizer's state lives (memory or a file); the step goes through it.
        self._opt_state = state_store(
            cfg,
            self._optimizer_set.state,
            self._opt_views,
            self.groups.global_rank,  # names its file
            on_memory=self._memory.sample,
        )
        self._store_finalizer = weakref.finalize(self, self._opt_state.closer())
        self.fused_step = self._fused[0]
        # optimizer.zero_grad() (what Lightning and most loops call) and model.zero_grad()
        # (Hugging Face's Trainer, many plain loops) must clear the engine's gradient
        # buffers: at stages 2-3 the parameters hold no .grad for them to clear. Each
        # optimizer clears its own parameters' gradients, the model all of them.
        for opt in optimizers:
            route_zero_grad(opt, functools.partial(self.zero_grad, optimizer=opt))
        route_zero_grad(model, self.zero_grad)
        self._groups_off: set[int] = set()  # param groups whose requires_grad is off
        self._converted_named: set[str] = set()  # replaced by another dtype, warned once
        if len(optimizers) > 1:
            owners = {id(p) for u in self.units for s, p in zip(u.layout.slots, u.params)}
            self._handles += [
                module.register_forward_pre_hook(
                    EngineHook(lambda *_: self._follow_requires_grad())
                )
                for module in model.modules()
                if any(id(p) in owners for p in module.parameters(recurse=False))
            ]
        self._inside_step = False

        self.scaler = LossScaler(cfg)
        self.gather: GatherManager | None = None
        self.reducer = GradReducer(
            self.units,
            self.stage,
            cfg.overlap_comm,
            cfg.reduce_torch_dtype,
            on_unit_ready=self._on_unit_grads_ready,
            on_backward_end=self._on_backward_end,
            on_memory=self._memory.sample,
            before_reduction=self._check_module_paths,
            before_backward_end=self._check_backward_path,
            on_grads_landed=self._note_landed_norm,
        )
        self.publisher = (
            ParameterPublisher(model, self.units, cfg.overlap_param_gather)
            if self.stage in (1, 2)
            else None
        )
        if self.stage == 3:
            self.gather = GatherManager(
                model,
                self.units,
                self.groups.order_tags() if cfg.verify_module_order else None,
                cfg.prefetch_depth,
                cfg.persistence_threshold,
                cfg.max_reuse_distance,
                on_backward_start=self.reducer.backward_started,
                on_memory=self._memory.sample,
                finish_reductions=self.reducer.finish_sent,
            )
        # The per-unit disk tiers (None where the tensors stay in memory): the bf16/fp16
        # masters between steps, stage 3's parameter shards between uses, and the
        # gradients' fp32 shards from their reduction to the step (the norm noted as they
        # land), through one set of host buffers.
        self._staging = StagingBuffers(cfg.offload_buffer_count, on_memory=self._memory.sample)
        tiers = unit_tiers(
            cfg,
            self.units,
            self.stage,
            self.groups.global_rank,
            self._staging,
            on_memory=self._memory.sample,
        )
        self._masters, self._shards, self._grads = tiers.masters, tiers.shards, tiers.grads
        self._tier_finalizers = [weakref.finalize(self, t.closer()) for t in tiers.present()]
        self._landed_norms = LandedNorms(cfg.master_torch_dtype)
        self._module_state = ModuleStateHooks(
            model, self.units, self.gather, self.wait_for_parameters
        )
        self._full_parameters = FullParameters(
            self.units, self.gather, self.wait_for_parameters, self.groups.mesh, self.groups.tensor
        )
        self._full_grads = FullGrads(self.units, self.stage, self.gather, self._module_state.owner)
        self._grads_unscaled = False
        self._grads_live = False
        self._buffers_stale = True  # DDP's require_forward_param_sync, for buffers
        self._backward_pending = False
        self._handles += [
            model.register_forward_pre_hook(EngineHook(lambda *_: self.before_forward())),
            model.register_forward_hook(EngineHook(lambda *_: self.after_forward())),
        ]
        self._norms: dict[tuple[int, ...] | None, torch.Tensor] = {}  # this step's, by groups
        self.global_steps = 0
        self.reset_comm_report()
        self._memory.reset()

    @property
    def world_size(self) -> int:
        """Data-parallel ranks (the processes of the default group, or with tensor
        parallelism the ranks at this rank's tensor-parallel position)."""
        return self.groups.world_size

    @property
    def tensor_parallel_size(self) -> int:
        return self.groups.mesh.tensor_size

    def _check_tensor_parallel(self, model: nn.Module, cfg: ZeroConfig) -> None:
        """Refuse, before any other collective, what tensor parallelism cannot do here."""
        named = list(model.named_parameters())
        check_tensor_parameters(named, self.groups.mesh)
        if self.tensor_parallel_size == 1:
            return
        # The (Hugging Face) config of the model, or of one held inside it (Lightning's).
        config = next((m.config for m in model.modules() if hasattr(m, "config")), None)
        check_head_counts(named, config, self.tensor_parallel_size)
        if expert_layers(model) or cfg.expert_parallel_size > 1:
            raise ValueError(
                "Tensor parallelism with MoE layers is not supported yet: use "
                "tensor_parallel_size=1 with expert parallelism, or a dense model."
            )

    @property
    def rank(self) -> int:
        return self.groups.rank

    def _layouts(self, model, params, group_of, placed) -> list[UnitLayout]:
        """Units and their specs: stage 3 makes every placed module a unit of its own;
        stages 1-2 never put parameters of two specs in one bucket."""
        cfg, world = self.config, ShardSpec.world(self.world_size)
        if cfg.stage == 3 and self.stage != 3:  # one process: check the names all the same
            select_unit_modules(model, cfg.unit_module_classes)
        if self.stage == 3:
            chosen = set(select_unit_modules(model, cfg.unit_module_classes)) | set(placed)
            chosen |= set(frozen_leftover_modules(model, chosen))
            unit_paths = [path for path, _ in model.named_modules() if path and path in chosen]

            def spec_of_unit(path: str) -> ShardSpec:
                governing = spec_of_owner(path, placed)
                return placed[governing] if governing is not None else world

            return module_layouts(model, params, group_of, unit_paths, spec_of_unit)

        def spec_of(p) -> ShardSpec:
            governing = placed_path_of_names(p.names, placed)
            return placed[governing] if governing is not None else world

        # Stage 0 is replicated: one "shard" per unit, no padding to the world size.
        return bucket_layouts(params, group_of, cfg.bucket_size, spec_of, sharded=self.stage > 0)

    def _model_names(self) -> set[str]:
        """The stored names of the whole model: this rank's, and the experts of every
        other expert-parallel rank."""
        return {
            self._stored(unit, name, slot.shape, copy).name
            for unit in self.units
            for slot in unit.layout.slots
            for name in (slot.name, *slot.aliases)
            for copy in range(unit.group.spec.copies)
        }

    def _stored(
        self, unit: FlatUnit, name: str, shape: tuple[int, ...], copy: int | None = None
    ) -> Stored:
        """Where a parameter is checkpointed and consolidated: under its own name, or for
        a distinct copy (`copy`, default this rank's: an expert-parallel rank's experts)
        under its global name, or as its rows of a batched weight."""
        if unit.group.spec.replicated:
            placed = self._tensor_sharded.get(name)
            if placed is not None:  # this position's block of the full tensor
                return Stored(name, placed.full_shape, placed.offset)
            return Stored(name, tuple(shape))
        copy = unit.group.copy_index if copy is None else copy
        return self._expert_names.stored(name, copy, tuple(shape))

    # ================================================================ set-up helpers
    def _warn_unoptimized(self, params, group_of) -> None:
        missing = [
            p.names[0] for p in params if p.param.requires_grad and id(p.param) not in group_of
        ]
        if missing:
            warnings.warn(
                f"{len(missing)} parameter(s) require grad but are in no optimizer group "
                f"(e.g. {missing[:3]}); they are treated as frozen. Add them to the optimizer "
                "or set requires_grad=False to silence this.",
                stacklevel=3,
            )

    def _check_sizes(self, params, group_of) -> None:
        trainable = sum(p.param.numel() for p in params if id(p.param) in group_of)
        if trainable == 0:
            raise ValueError(
                "No parameter of the model is both trainable and in the optimizer. Build the "
                "optimizer over the model's parameters that require grad."
            )
        # A model with fewer elements than ranks is fine: a rank whose shard is padding
        # alone steps nothing (its optimizer holds empty views) and trains as DDP does.

    def _check_same_model_on_all_ranks(self, params, group_of, placed) -> None:
        """A different model (or placement) on some rank would pair mismatched collectives,
        or create mismatched groups: refuse early."""
        if not self._world.distributed:
            return
        desc = (
            "|".join(
                f"{p.names[0]}:{tuple(p.local.shape)}:{p.param.dtype}:{group_of.get(id(p.param), FROZEN_GROUP)}:{p.tensor}"
                for p in params
            )
            + "|"
            + "|".join(f"{path}:{spec.describe()}" for path, spec in placed.items())
        )
        digest = int.from_bytes(hashlib.sha1(desc.encode()).digest()[:7], "little")
        tags = self._world.control_all_gather(
            torch.tensor([digest, self.config.stage], dtype=torch.int64, device=self.device)
        ).tolist()
        if any(t != tags[0] for t in tags):
            raise ValueError(
                "The model, optimizer groups, placement or ZeRO stage differ across ranks "
                f"(per-rank [digest, stage]: {tags}). Every rank must build the same model, "
                "the same optimizer param groups, the same placement and the same ZeroConfig."
            )

    def _materialize(self, model: nn.Module, on_meta: bool, init_fn) -> None:
        """Give every unit its initial values: its shard group's first rank's, then (for a
        unit with several copies) the first copy's; one unit at a time at stage 3."""

        def flat_for(unit: FlatUnit) -> torch.Tensor:
            return torch.zeros(
                unit.layout.padded_numel, dtype=unit.master_dtype, device=self.device
            )

        def point(unit: FlatUnit, flat: torch.Tensor) -> None:
            for slot, local in zip(unit.layout.slots, unit.locals):
                local.data = flat[slot.offset : slot.end].view(slot.shape)

        def copy_in(unit: FlatUnit, flat: torch.Tensor) -> None:
            for slot, local in zip(unit.layout.slots, unit.locals):
                flat[slot.offset : slot.end].copy_(local.detach().reshape(-1))

        def agree(unit: FlatUnit, flat: torch.Tensor) -> None:
            unit.group.comm.broadcast(flat, src=0)
            if unit.group.summed_over_copies is not None:  # every copy starts from copy 0's
                unit.group.summed_over_copies.broadcast(flat, src=0)
            if self.groups.tensor is not None:  # whole parameters: position 0's values
                broadcast_whole_parameters(flat, unit.layout.slots, self.groups.tensor, src=0)

        def sharded_targets(unit: FlatUnit, flat: torch.Tensor):
            return [
                ((s.name, *s.aliases), s.tensor, flat[s.offset : s.end])
                for s in unit.layout.slots
                if s.tensor_sharded
            ]

        if on_meta and self.stage < 3:
            flats = [flat_for(u) for u in self.units]
            for unit, flat in zip(self.units, flats):
                point(unit, flat)
            slots = [s for u in self.units for s in u.layout.slots]
            owners = meta_init.owner_modules(model, slots)
            targets = [t for u, f in zip(self.units, flats) for t in sharded_targets(u, f)]
            if not targets:
                meta_init.run_init(model, owners, init_fn)
            # Tensor-sharded parameters are initialised whole: one module's at a time.
            for path, module in owners if targets else ():
                mine = [t for t in targets if owner_of(t[0][0]) == path]
                with whole_for_init(model, mine):
                    meta_init.run_init(model, [(path, module)], init_fn)
            for unit, flat in zip(self.units, flats):
                agree(unit, flat)
                unit.install(flat)
            return
        for unit in self.units:
            flat = flat_for(unit)
            if on_meta:
                point(unit, flat)
                with whole_for_init(model, sharded_targets(unit, flat)):
                    meta_init.run_init(
                        model, meta_init.owner_modules(model, unit.layout.slots), init_fn
                    )
            else:
                copy_in(unit, flat)
            agree(unit, flat)
            unit.install(flat)
            del flat

    def _repoint_optimizer(self) -> None:
        """Point the optimizer at 1-D views of the fp32 masters, one per (unit, group)
        segment, and remember which gradient slice belongs to each."""
        by_group: dict[int, list[tuple[FlatUnit, int, int]]] = {}
        # State streamed from disk is stepped a tile at a time: no view may be larger.
        most = self.config.offload_tile_size if self.config.offload_optimizer == "disk" else 0
        for unit in self.units:
            for seg in unit.layout.segments(unit.opt_start, unit.opt_end):
                lo, hi = seg.start - unit.opt_start, seg.end - unit.opt_start
                cuts = range(lo, hi, most) if most and hi > lo else [lo]
                by_group.setdefault(seg.group_index, []).extend(
                    (unit, a, min(hi, a + most) if most else hi) for a in cuts
                )
        # Every group has a view on every rank (an empty one where none of its elements
        # is this rank's), so that a group's requires_grad (Lightning's toggle_optimizer)
        # reads the same everywhere.
        optimizers = self._optimizer_set
        for gi, group in enumerate(optimizers.param_groups):
            if gi not in by_group and group["params"]:
                first = next(u for u in self.units for s in u.layout.slots if s.group_index == gi)
                by_group[gi] = [(first, 0, 0)]
        for k, opt in enumerate(optimizers.optimizers):
            offset = optimizers.group_offsets[k]
            repoint_optimizer(
                opt,
                {
                    gi - offset: [u.master[lo:hi] for u, lo, hi in by_group[gi]]
                    for gi in optimizers.groups_of(k)
                    if gi in by_group
                },
            )
        all_groups = optimizers.param_groups
        self._opt_views = [
            OptimizerView(
                unit,
                lo,
                hi,
                opt_param,
                gi,
                unit.grad_opt[lo:hi] if unit.grad_opt is not None else None,
            )
            for gi, segs in by_group.items()
            for (unit, lo, hi), opt_param in zip(segs, all_groups[gi]["params"])
        ]
        # Stepped unit by unit, each shard (parameters, masters, gradients) read once.
        if self._units_on_disk:
            self._opt_views.sort(key=lambda view: view.unit.layout.index)

    # ================================================================ stage-3 glue
    def _check_module_paths(self) -> None:
        if self.gather is not None:
            self.gather.check_uses()

    def _check_backward_path(self) -> None:
        if self.gather is not None:
            self.gather.end_of_backward_check()

    def _on_unit_grads_ready(self, unit: FlatUnit) -> None:
        if self.gather is not None:
            self.gather.grads_ready(unit)

    def _on_backward_end(self) -> None:
        if self.gather is not None:
            self.gather.release_all()
            self.gather.end_of_pass()
        # Expose the gradients to the optimizer params: a zero_grad() that bypasses the
        # engine (an optimizer wrapper calling Optimizer.zero_grad) shows up as None here.
        self._expose_grads()
        self._grads_live = True
        self._backward_pending = False
        if self.config.keep_full_grads and self.reducer.sync:
            self._full_grads.show()
        elif self.config.keep_full_grads:
            self._full_grads.show_local(self.reducer.local_sums)

    def _expose_grads(self) -> None:
        """The optimizer's parameters' `.grad`: views of the gradient shards; None where
        the shard is offloaded (its memory is there only while it is in use)."""
        for view in self._opt_views:
            view.param.grad = view.grad if view.unit.grad_home is None else None

    def before_forward(self) -> None:
        """Runs before every forward of the root module. A framework that runs the model
        through a method other than the root's forward (Lightning's training_step) calls
        it, and `after_forward`, itself, as DDP's forward redirection does."""
        self._zero_if_cleared_elsewhere()
        self._adopt_replaced_data()
        self._opt_state.settle(wait=False)  # the last step's writes: their buffers go
        if self._grads is not None:
            self._grads.settle(wait=False)
        self._full_grads.hide()
        self.reducer.rehook_converted()
        if self.config.broadcast_buffers and self._buffers_stale:
            self._sync_buffers()
            self._buffers_stale = False

    def begin_step(self) -> None:
        """What the root module's forward pre-hooks do, for a framework that runs the
        user's step (Lightning's `training_step`, `test_step`) instead of the root's
        forward: `before_forward`, and at stage 3 the root unit gathered, so that the root
        module's own parameters read directly in the step (`self.layer.weight.item()`) are
        whole, as they are inside the root's forward (and under DDP). Pair it with
        `after_forward`; an evaluation step then `reshard()`s."""
        self.before_forward()
        if self.gather is not None:
            self.gather.begin_step()

    def after_forward(self) -> None:
        """As DDP: a forward followed by a synchronised backward may have changed buffers
        (BatchNorm statistics); the next forward, of any kind, starts from rank 0's.
        Evaluation and no_sync() forwards leave them as they are."""
        if not in_backward():
            self._buffers_stale = torch.is_grad_enabled() and self.reducer.sync
            self._backward_pending = torch.is_grad_enabled()

    @property
    def in_step(self) -> bool:
        """A training forward ran and its backward has not yet: the caller is inside a
        training step (so `unshard()` there would only hold memory backward needs)."""
        return self._backward_pending

    def _sync_buffers(self) -> None:
        """DDP's broadcast_buffers: rank 0's buffers overwrite every rank's, one collective
        per dtype, so that every rank trains and evaluates with the statistics DDP would
        give it."""
        if not self._world.distributed:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buf in self.module.buffers():
            if buf.device.type == self.device.type and buf.numel():
                by_dtype.setdefault(buf.dtype, []).append(buf)
        for bufs in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in bufs])
            self._world.broadcast(flat, src=0, kind="buffers")
            for buf, value in zip(bufs, flat.split([b.numel() for b in bufs])):
                buf.copy_(value.view_as(buf))

    def _adopt_replaced_data(self) -> None:
        """Stages 0-2: parameters whose `.data` was replaced since the last look (a
        lottery-ticket reset, `prune.remove`) go on training from the written values, as
        under DDP (`replaced_data`); replaced by another dtype, they are named once."""
        if self.stage == 3:
            return
        found = [(unit, replaced_slots(unit)) for unit in self.units]
        converted = [
            unit.layout.slots[i].name
            for unit, (_, other) in found
            for i in other
            if unit.layout.slots[i].name not in self._converted_named
        ]
        if converted:
            self._converted_named.update(converted)
            warnings.warn(
                converted_warning(converted, self.config.compute_torch_dtype), stacklevel=3
            )
        written = [(unit, slots) for unit, (slots, _) in found if slots]
        if not written:
            return
        self._finish_parameter_gathers()  # a post-step gather into the same buffers first
        for unit, slots in written:
            adopt_replaced(unit, slots)

    def _zero_if_cleared_elsewhere(self) -> None:
        """Honour a zero_grad() that did not come through the engine: optimizer params
        (or, at stages 0-1, model params) whose .grad was set to None since backward."""
        if not self._grads_live:
            return
        cleared = {
            v.group_index
            for v in self._opt_views
            if v.param.grad is None and v.unit.grad_home is None  # offloaded: never shown
        }
        if self.stage < 2:
            cleared |= {
                s.group_index
                for u in self.units
                for s, p in zip(u.layout.slots, u.params)
                if s.trainable and p.grad is None
            }
        if cleared >= set(range(len(self._optimizer_set.param_groups))):
            self.zero_grad()
        elif cleared:  # one optimizer's zero_grad (of several)
            self._zero_groups(cleared)

    def _follow_requires_grad(self) -> None:
        """Lightning's `toggle_optimizer` switches requires_grad off on the other
        optimizers' parameters, which are the engine's shard views: the model's own
        parameters follow, group by group, before each module's forward."""
        off = {v.group_index for v in self._opt_views if not v.param.requires_grad}
        if off == self._groups_off:
            return
        self._groups_off = off
        for unit in self.units:
            for slot, p in zip(unit.layout.slots, unit.params):
                if slot.trainable:
                    p.requires_grad_(slot.group_index not in off)

    # ================================================================ training API
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward with the fp16 loss scale applied; reductions run during it."""
        self.scale_loss(loss).backward(**kwargs)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Prepare for a backward the caller runs: finish parameter gathers, honour an
        outside zero_grad(), and return the loss times the fp16 loss scale."""
        self.wait_for_parameters()
        self._zero_if_cleared_elsewhere()
        self._full_grads.hide()
        return loss * self.scaler.scale if self.scaler.enabled else loss

    def unshard(self) -> None:
        """Stage 3: gather every unit and keep it gathered until the module's next use
        frees it (its forward, the next step, or `reshard()`): the whole model readable
        outside forward, as an unwrapped DDP model is, at the cost of holding all of it.
        Collective. Writes to it are not kept; use `gathered_parameters()` to write."""
        if self.gather is None:
            self.wait_for_parameters()
            return
        for unit in self.units:
            self.gather.ensure(unit, STATE_DICT)

    def reshard(self) -> None:
        """Stage 3: free every gathered unit now (e.g. after an evaluation batch that
        did not go through the root module's forward). The spare gather buffers kept for
        reuse (one per unit size) stay."""
        if self.gather is not None:
            self.gather.release_all()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally without communication (all but the last
        micro-batch). At stages 2-3 this holds full-size gradients until the next
        synchronised backward."""
        return self._reducing(False)

    def synchronised(self) -> contextlib.AbstractContextManager[None]:
        """The backward inside reduces, even within `no_sync()` (Accelerate's
        `trigger_sync_in_backward`: several forwards under no_sync, the last backward
        synchronised)."""
        return self._reducing(True)

    @contextlib.contextmanager
    def _reducing(self, sync: bool) -> Iterator[None]:
        previous = self.reducer.sync
        self.reducer.sync = sync
        try:
            yield
        finally:
            self.reducer.sync = previous

    def clip_grad_norm_(
        self, max_norm: float, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.Tensor:
        """Clip by the global L2 norm over all shards (of `optimizer`'s parameters, when
        given); returns the norm before clipping."""
        if max_norm <= 0:
            raise ValueError(f"max_norm must be positive, got {max_norm}.")
        _, groups = self._chosen(optimizer)
        norm, overflow = self._unscale_and_measure(groups)
        if not overflow:
            coef = max_norm / (float(norm) + 1e-6)
            if coef < 1.0:
                self._scale_grads(coef, groups)
        return norm

    def clip_grad_value_(
        self, clip_value: float, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Clamp every gradient element (of `optimizer`'s parameters, when given) to
        [-clip_value, clip_value]: elementwise, so exact on shards."""
        if clip_value <= 0:
            raise ValueError(f"clip_value must be positive, got {clip_value}.")
        _, groups = self._chosen(optimizer)
        _, overflow = self._unscale_and_measure(groups)
        if not overflow:
            self._change_grads(groups, lambda grad: grad.clamp_(-clip_value, clip_value))
            self._full_grads.clamp(clip_value, groups)

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """One optimizer step over this rank's shards, then refresh the compute copies:
        every optimizer's, or only `optimizer`'s (its own gradients clipped by their own
        norm, as `clip_grad_norm_` over its parameters would). Returns False when the step
        was skipped for an fp16 overflow."""
        if self._stepped_in_parts:  # a write of the last step failed on some rank: raise
            agree_on_write_failures(self._offload_tiers(), self.groups.everyone)
        self.wait_for_parameters()
        chosen, groups = self._chosen(optimizer)
        norm, overflow = self._unscale_and_measure(groups)
        if overflow:
            self.scaler.update(True)
            self._grads_unscaled = False
            self.zero_grad()
            return False
        if self.config.gradient_clipping > 0:
            coef = self.config.gradient_clipping / (float(norm) + 1e-6)
            if coef < 1.0:
                self._scale_grads(coef, groups)
        self._expose_grads()
        written = [True]  # whether every update also wrote the compute copies

        def step_tile(tile: list[OptimizerView]) -> None:
            written[0] &= self._step_optimizers(chosen, tile)
            if self.config.ema_decay:
                self._ema.update(self.config.ema_decay, groups, tile)
            if self._masters_offloaded:  # while the masters are in memory
                for view in tile:
                    view.unit.sync_compute_from_master(view.lo, view.hi)

        chosen_groups = {gi for k in chosen for gi in self._optimizer_set.groups_of(k)}
        self._run_user_hooks(chosen, before=True)
        self._apply(
            [v for v in self._opt_views if v.group_index in chosen_groups],
            step_tile,
            needs_grads=True,
        )
        written[0] |= self._masters_offloaded
        self._expose_grads()
        self._run_user_hooks(chosen, before=False)
        self.scaler.update(False)
        self._memory.resync()  # the first step creates the optimizer state
        if self.stage == 3:  # the parameters the shown gradients belong to are re-sharded
            self._full_grads.hide()
        # The fused kernel wrote the compute copies in the same pass.
        self._publish_parameters(copies_written=written[0], after_step=True)
        self._grads_unscaled = False
        self._norms.clear()
        self.global_steps += 1
        return True

    def _run_user_hooks(self, chosen: list[int], before: bool) -> None:
        """With the state offloaded, each optimizer's step runs in parts: the user's step
        hooks run here instead, once, with every gradient in place, as around one
        `optimizer.step()` (torch's order: global then own pre-hooks, own then global
        post-hooks)."""
        if not self._stepped_in_parts:
            return  # optimizer.step() runs them
        hooks = [
            (self.optimizers[k], hook)
            for k in chosen
            for hook in user_step_hooks(self.optimizers[k], self._guards[k].id)[0 if before else 1]
        ]
        if not hooks:
            return
        with self._every_grad_in_memory(chosen):
            for opt, hook in hooks:
                hook(opt, (), {})

    @contextlib.contextmanager
    def _every_grad_in_memory(self, chosen: list[int]) -> Iterator[None]:
        """Every gradient of the `chosen` optimizers shown on their parameters inside the
        block: the offloaded shards read in for it (what the user's step hooks may read
        or change, as without offload), and written back after it."""
        groups = {gi for k in chosen for gi in self._optimizer_set.groups_of(k)}
        units = {v.unit.layout.index: v.unit for v in self._opt_views if v.group_index in groups}
        with contextlib.ExitStack() as in_memory:
            for unit in units.values():
                if unit.grad_home is not None:
                    in_memory.enter_context(unit.grads_resident(modified=True))
                    self._landed_norms.forget(unit.layout.index)
            for view in self._opt_views:
                shown = view.unit.grad_home is None or view.group_index in groups
                view.param.grad = view.grad if shown else None
            try:
                yield
            finally:
                self._expose_grads()

    def _offload_tiers(self) -> list:
        tiers = (self._opt_state, self._masters, self._shards, self._grads)
        return [t for t in tiers if t is not None]

    def _settle_writes(self) -> None:
        """Before the tiers' files are read whole (a save): every write is done, and one
        that failed makes the read refuse (the file is behind the training)."""
        for tier in self._offload_tiers():
            tier.settle(wait=True)
            if tier.failure is not None:
                tier.refuse()

    @property
    def _masters_offloaded(self) -> bool:
        """Whether the masters (with the parameter shards, or in a tier of their own) are
        in files between steps: the step then brings them in unit by unit."""
        return self._shards is not None or self._masters is not None

    @property
    def _stepped_in_parts(self) -> bool:
        """Whether the optimizers step a few views at a time (offloaded state or shards)."""
        return self._opt_state.offloaded or self._shards is not None

    def _apply(
        self,
        views: list[OptimizerView],
        step: Callable[[list[OptimizerView]], None],
        changes_weights: bool = True,
        needs_grads: bool = False,
    ) -> None:
        """`step` over `views`, a tile at a time through the optimizer state's store. With
        the shards offloaded (and the gradient shards, if `needs_grads`), each unit's is in
        memory while its views step (from its first tile to its last: the views are in
        unit order then), the next unit's is read ahead, and the parameter shard is
        written back if `changes_weights`."""
        grads = needs_grads and self._grads is not None
        for unit in self.units:  # the masters change here: their copies out must be done
            unit.wait_for_copies_back()
        if not self._masters_offloaded and not grads:
            self._opt_state.apply(views, step)
            return
        units = [unit for unit, _ in itertools.groupby(views, key=lambda v: v.unit)]
        following = dict(itertools.pairwise(units))
        with (
            OneResident(modified=changes_weights) as in_memory,
            OneResident(grads=True) as grads_in_memory,
        ):

            def run(tile: list[OptimizerView]) -> None:
                for unit, unit_views in itertools.groupby(tile, key=lambda v: v.unit):
                    if in_memory.unit is not unit and unit in following:
                        following[unit].prefetch_master()
                        if grads:
                            following[unit].prefetch_grads()
                    in_memory(unit)
                    if grads:
                        grads_in_memory(unit)
                    step(list(unit_views))

            self._opt_state.apply(views, run)

    def _step_optimizers(self, chosen: list[int], tile: list[OptimizerView]) -> bool:
        """Step the `chosen` optimizers over their views in `tile`: all of them, or with
        the state offloaded one tile at a time, the other views' gradients hidden so that
        the optimizer skips them and the user's hooks left to `_run_user_hooks`. Returns
        whether every update also wrote the compute copies (the fused kernel)."""
        partial = self._stepped_in_parts
        copies_written = True
        for k in chosen:
            opt, fused = self.optimizers[k], self._fused[k]
            groups = self._optimizer_set.groups_of(k)
            views = [v for v in tile if v.group_index in groups]
            if not views:
                continue
            if not partial and fused is not None and fused.applies([v.param for v in views]):
                fused.step(self._fused_views(opt))
                continue
            copies_written = False
            hooks = contextlib.nullcontext()
            if partial:
                shown = {id(v) for v in views}
                for view in self._opt_views:
                    if view.group_index in groups:
                        grad = view.grad
                        view.param.grad = grad if id(view) in shown else None
                hooks = without_user_step_hooks(opt, self._guards[k].id)
            self._inside_step = True
            try:
                with hooks:
                    opt.step()
            finally:
                self._inside_step = False
        return copies_written

    # ================================================================ EMA
    def update_ema(self, decay: float) -> None:
        """Fold the current weights into the sharded EMA (the first call copies them):
        `ema += (1 - decay) * (weights - ema)`, on this rank's shards only (local). Held
        in the optimizer state, so checkpoints save it and load it at any world size."""
        if self.global_steps == 0 and not self._ema.started:
            raise RuntimeError(
                "update_ema() before the first step: the EMA starts from trained weights "
                "(and an optimizer's state is created by its first step). Call it after "
                "engine.step()."
            )
        self._apply(
            self._opt_views, lambda tile: self._ema.update(decay, None, tile), changes_weights=False
        )

    @property
    def ema_started(self) -> bool:
        """Whether the sharded EMA holds an average yet (after its first update)."""
        return self._ema.started

    def swap_ema(self) -> None:
        """Exchange the weights and their EMA (a second call undoes it); the compute
        copies follow. Collective at stages 1-3 (the parameters are re-gathered)."""
        self.wait_for_parameters()
        if not self._ema.started:
            self._ema.swap()  # raises, naming the fix
        self._apply(self._opt_views, self._ema.swap)
        self.refresh_from_masters()

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """The EMA weights in the model inside the block (validation, a sample), the
        trained ones again after it."""
        self.swap_ema()
        try:
            yield
        finally:
            self.swap_ema()

    def _chosen(self, optimizer) -> tuple[list[int], set[int] | None]:
        """Optimizer positions, and their param groups (None: every optimizer)."""
        if optimizer is None:
            return list(range(len(self.optimizers))), None
        k = self._optimizer_set.index_of(getattr(optimizer, "optimizer", optimizer))
        if len(self.optimizers) == 1:
            return [0], None
        return [k], set(self._optimizer_set.groups_of(k))

    def parameter_numel(self, param: torch.Tensor) -> int:
        """Elements of `param` in the full model, also while stage 3 holds it freed (for
        summaries and counts that would otherwise read 0)."""
        owned = self._module_state.owner.get(id(param))
        return owned[1].numel if owned is not None else param.numel()

    def manages(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is one of the model's parameters or one of the optimizer's
        shard views (what `clip_grad_norm_(optimizer params)` style calls hand over)."""
        return id(tensor) in self._module_state.owner or any(
            tensor is v.param for v in self._opt_views
        )

    def parameter_names(self) -> set[str]:
        """Every name (tied aliases included) under which the model holds a parameter."""
        return {
            name
            for unit in self.units
            for slot in unit.layout.slots
            for name in (slot.name, *slot.aliases)
        }

    def gathered_parameters(
        self,
        modules: nn.Module | Iterable[nn.Module] | None = None,
        modifier_rank: int | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """Full parameters of `modules` (all when None) inside a `with` block, at every
        stage; writes made inside it reach the fp32 masters on exit: `modifier_rank`'s
        (broadcast to the others), or with None each rank's own slice. Collective: every
        rank enters and leaves it. Holds those modules' full parameters meanwhile."""
        return self._full_parameters.gathered(modules, modifier_rank)

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """`param`'s full reduced (and clipped, unscaled) gradient in fp32, or None if it
        is frozen. Collective over the ranks sharding its unit at stages 2-3."""
        self.reducer.wait()
        return self._full_grads.grad(param, self._scale_left_in_grads())

    def full_grads(self, module: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The full reduced gradients of `module`'s trainable parameters (the whole model
        when None), by name, each unit gathered once. Collective (every rank)."""
        self.reducer.wait()
        module = module if module is not None else self.module
        return self._full_grads.grads_of(module, self._scale_left_in_grads())

    def _scale_left_in_grads(self) -> float:
        """The fp16 loss scale the gradients still carry (1 once unscaled, or without one)."""
        return 1.0 if self._grads_unscaled or not self.scaler.enabled else self.scaler.scale

    def wait_for_parameters(self) -> None:
        """Finish the post-step parameter gathers (stages 1-2), and take in `.data` written
        since (stages 0-2), before the full parameters are read or written outside the
        module's forward: a checkpoint, a state dict, a step."""
        self._finish_parameter_gathers()
        self._adopt_replaced_data()

    def _finish_parameter_gathers(self) -> None:
        if self.publisher is not None:
            self.publisher.wait_all()

    def zero_grad(
        self, set_to_none: bool = True, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Zero the gradient buffers: all, or those of `optimizer`'s parameters (what its
        own `zero_grad()` does). They are kept allocated; `set_to_none` is accepted for
        API compatibility."""
        self.reducer.wait()
        self._full_grads.hide()
        _, groups = self._chosen(optimizer)
        self._norms.clear()
        if groups is not None:
            self._zero_groups(groups)
            return
        self._landed_norms.clear()
        self.reducer.zero_grad()
        for view in self._opt_views:
            view.param.grad = None
        self._grads_unscaled = False
        self._grads_live = False

    def _zero_groups(self, groups: set[int]) -> None:
        self._change_grads(groups, torch.Tensor.zero_)
        for view in self._opt_views:
            if view.group_index in groups:
                view.param.grad = None

    # ================================================================ step internals
    def _unscale_and_measure(self, groups: set[int] | None = None) -> tuple[torch.Tensor, bool]:
        """Wait for reductions, compute the global grad norm (unscaled) of every param
        group or of `groups`, once per step, and divide the loss scale out of the
        gradients."""
        self.reducer.wait()
        key = None if groups is None else tuple(sorted(groups))
        if key in self._norms:
            return self._norms[key], False
        sq = self._local_sum_squares(groups)
        self.groups.everyone.control_all_reduce(sq)  # tensor-parallel ranks too
        scale = 1.0 if self._grads_unscaled else self.scaler.scale
        norm = sq.sqrt()[0] / scale
        overflow = not bool(torch.isfinite(norm))
        if overflow:
            return norm, True
        if scale != 1.0:
            self._scale_grads(1.0 / scale)
        self._grads_unscaled = True
        self._norms[key] = norm
        return norm, False

    def _local_sum_squares(self, groups: set[int] | None) -> torch.Tensor:
        """This rank's part of the squared global norm, as a 1-element tensor."""
        if self._grads is not None:  # offloaded: the norms noted as the shards landed
            for unit in self.units:
                if not self._landed_norms.has(unit.layout.index):
                    with unit.grads_resident():
                        self._note_landed_norm(unit)
            indices = [unit.layout.index for unit in self.units]
            return self._landed_norms.sum_squares(indices, groups).to(self.device)
        shards = [
            part
            for unit in self.units
            for gi, part in self._norm_slices(unit)
            if groups is None or gi in groups
        ]
        # One fused pass over every shard (Triton on CUDA, torch's foreach norm elsewhere).
        master_dtype = self.config.master_torch_dtype
        if not shards:
            return torch.zeros(1, dtype=master_dtype, device=self.device)
        if master_dtype == torch.float64:  # fp64 training: the norm in fp64, as torch's
            norms = torch.stack(torch._foreach_norm(shards, 2.0))
            return norms.square().sum().reshape(1).to(self.device)
        if self._host != self.device:  # the shards in host memory: summed there
            return reference_sum_squares(shards).reshape(1).to(self.device)
        return multi_tensor_sum_squares(shards).reshape(1).to(self.device)

    def _norm_slices(self, unit: FlatUnit) -> list[tuple[int, torch.Tensor]]:
        """(param group, slice of the fp32 gradient shard) that this rank counts in the
        global norm, for `unit`. Each element once: a unit with several copies counts its
        first copy's shards (all of distinct copies); at stage 0 only a copy's first rank
        counts its whole copy."""
        if not (unit.group.primary and (self.stage > 0 or unit.group.rank == 0)):
            return []
        return [
            (seg.group_index, unit.grad_opt[lo - unit.opt_start : hi - unit.opt_start])
            for seg in unit.layout.segments(unit.opt_start, unit.opt_end)
            for lo, hi in self._counted_in_norm(unit, seg.start, seg.end)
        ]

    def _note_landed_norm(self, unit: FlatUnit) -> None:
        """A unit's reduced gradient is all in its shard (in memory now): with the shards
        offloaded, note its part of the norm before it leaves."""
        if self._grads is not None:
            self._landed_norms.note(unit.layout.index, self._norm_slices(unit))

    def _counted_in_norm(self, unit: FlatUnit, start: int, end: int) -> list[tuple[int, int]]:
        """The ranges of [start, end) this rank counts in the global norm: all of them,
        but with tensor parallelism a parameter whole on every tensor-parallel rank only
        at position 0 (its shards count everywhere: each position holds its own)."""
        if self.groups.tensor is None or self.groups.tensor.rank == 0:
            return [(start, end)]
        return [
            (max(start, s.offset), min(end, s.end))
            for s in unit.layout.slots
            if s.tensor_sharded and max(start, s.offset) < min(end, s.end)
        ]

    def _grad_parts(self, groups: set[int] | None) -> list[torch.Tensor]:
        """The gradient tensors of every param group (or of `groups`), each element once:
        the optimizer's slices, and at stages 0-1 the full buffers `.grad` views."""
        if groups is None:
            return [grad for unit in self.units for grad in unit.grad_buffers()]
        parts = []
        for unit in self.units:
            if unit.grad_opt is None:
                continue
            parts += _full_buffer_parts(unit, groups)
            buffers = unit.grad_buffers()
            if not (len(buffers) == 1 and buffers[0] is unit.grad_full):  # not a view of it
                parts += [unit.grad_opt[lo:hi] for lo, hi in _shard_ranges(unit, groups)]
        return parts

    def _scale_grads(self, factor: float, groups: set[int] | None = None) -> None:
        self._change_grads(groups, lambda grad: grad.mul_(factor))
        self._full_grads.scale(factor, groups)

    def _change_grads(
        self, groups: set[int] | None, change: Callable[[torch.Tensor], object]
    ) -> None:
        """`change` (in place, keeping zeros zero) on every gradient part of `groups` (or
        of all): at once, or with the shards offloaded, when each is next in memory."""
        if self._grads is None:
            for grad in self._grad_parts(groups):
                change(grad)
            return
        for unit in self.units:
            if unit.grad_opt is None:
                continue
            if groups is not None:  # no_sync's local sums, in memory: now
                for part in _full_buffer_parts(unit, groups):
                    change(part)
            ranges = _shard_ranges(unit, groups)
            if ranges:
                self._landed_norms.forget(unit.layout.index)
                parts = None if groups is None else ranges  # None: the whole shard
                unit.change_grads(functools.partial(_change_parts, change, unit, parts))

    def _fused_views(
        self, optimizer: torch.optim.Optimizer
    ) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]]:
        """Per param group, in the group's order: (master view, gradient view, the slice of
        the compute-dtype copy it must be written to, or None when that is the master)."""
        by_param = {}
        for view in self._opt_views:
            unit, lo, hi = view.unit, view.lo, view.hi
            if not unit.master_apart:
                copy = None
            elif self.stage < 3:
                copy = unit.full[unit.opt_start + lo : unit.opt_start + hi]
            else:
                copy = unit.shard[lo:hi]
            by_param[id(view.param)] = (view.param.detach(), view.param.grad, copy)
        return [[by_param[id(p)] for p in g["params"]] for g in optimizer.param_groups]

    def _publish_parameters(self, copies_written: bool = False, after_step: bool = False) -> None:
        """Make the updated shards visible: compute copies (unless the fused step wrote
        them; `after_step`, only those of units the step can change: a frozen unit's
        master is not stepped), then (stages 1-2) every rank's full parameters, (stage 3)
        units that stay gathered."""
        for unit in self.units:
            changed = unit.layout.trainable or not after_step
            if unit.layout.numel and changed and not copies_written:
                unit.sync_compute_from_master()
        if self.publisher is not None:
            self.publisher.launch()
        elif self.gather is not None:
            self.gather.release_all()  # units left gathered (unshard()) hold old values
            self.gather.regather_persistent()

    def _guard_direct_step(self, optimizer, args, kwargs) -> None:
        if not self._inside_step:
            raise RuntimeError(
                "optimizer.step() was called directly on an optimizer managed by ZeroEngine: "
                "gradients would not be reduced or clipped and the parameters would not be "
                "re-gathered. Call engine.step() instead."
            )

    # ================================================================ reports & state
    def memory_report(self) -> dict[str, int]:
        """Exact bytes held by this rank, by kind, and (`peak_<kind>`, `peak_total`) the
        most held at once since `reset_memory_peaks()` (or since the engine was built)."""
        return memory_report(
            self._held_bytes(),
            self._optimizer_set,
            self.stage,
            expert_units=[u for u in self.units if not u.group.spec.replicated],
            expert_params=[v.param for v in self._opt_views if not v.unit.group.spec.replicated],
            peaks=self._memory.peaks,
            disk=self._disk_bytes(),
            device=self.device,
        )

    def _disk_bytes(self) -> dict[str, int]:
        """Bytes in the offload files by kind, summed over the tiers."""
        disk = collections.Counter({"optimizer_state": self._opt_state.disk_bytes()})
        for tier in (self._masters, self._shards, self._grads):
            if tier is not None:
                disk.update(tier.disk_bytes())
        return dict(disk)

    def reset_memory_peaks(self, record_timeline: bool = False) -> None:
        """Start the `peak_*` figures of `memory_report()` over from what is held now.
        With `record_timeline`, also keep every change until the next reset (see
        `memory_timeline()`), for plots of a step."""
        self._memory.reset(record_timeline)

    def memory_timeline(self) -> list[tuple[float, dict[str, int]]]:
        """(time.perf_counter(), bytes by kind) at every change since
        `reset_memory_peaks(record_timeline=True)`; empty when none was requested."""
        return list(self._memory.timeline or ())

    def _transient_bytes(self) -> dict[str, int]:
        comm, pooled = self.reducer.transient_bytes()
        gathered = 0
        if self.gather is not None:
            gathered = self.gather.gathered_bytes()
            pooled += self.gather.storage_pool.spare_bytes
        transient = {"gathered_parameters": gathered, "comm_buffers": comm, "pooled": pooled}
        # The disk tiers' buffers, and the masters and gradient shards they bring in, are
        # in host memory: another memory than the device's on an accelerator.
        host = "host_" if self._host != self.device else ""
        offload_buffers = sum(b.numel() for b in self._offload_buffers())
        transient[f"{host}pooled"] = transient.get(f"{host}pooled", 0) + offload_buffers
        landing = self.reducer.host_landings.nbytes()  # reduced gradients on their way
        transient[f"{host}comm_buffers"] = transient.get(f"{host}comm_buffers", 0) + landing
        if self._grads is not None:  # offloaded gradient shards come and go in backward
            transient[f"{host}gradients"] = self._grads.resident_bytes()
        if self._masters is not None:  # offloaded masters come and go in the step
            transient[f"{host}master_params"] = self._masters.resident_bytes
        return transient

    def _offload_buffers(self) -> list[torch.Tensor]:
        return [
            *self._opt_state.buffers(),
            *self._staging.free,
            *(
                b
                for tier in (self._masters, self._shards, self._grads)
                if tier is not None
                for b in tier.buffers()
            ),
        ]

    def _pooled_storages(self) -> list[torch.UntypedStorage]:
        return self.gather.storage_pool.storages() if self.gather else []

    def _held_bytes(self) -> dict[str, int]:
        return held_bytes(
            self.units,
            self._optimizer_set,
            self.module,
            self.stage,
            comm_tensors=self.reducer.comm_buffers(),
            pooled_tensors=[*self.reducer.pooled_buffers(), *self._offload_buffers()],
            pooled_storages=self._pooled_storages(),
            device=self.device,
        )

    def comm_report(self) -> dict[str, dict[str, int]]:
        """Bytes and calls per collective kind since the last `reset_comm_report()`, summed
        over every group this rank communicates in."""
        total: dict[str, dict[str, int]] = {}
        for comm in self.groups.communicators():
            for kind, counts in comm.report().items():
                entry = total.setdefault(kind, {"bytes": 0, "calls": 0})
                entry["bytes"] += counts["bytes"]
                entry["calls"] += counts["calls"]
        return dict(sorted(total.items()))

    def reset_comm_report(self) -> None:
        for comm in self.groups.communicators():
            comm.reset()

    def _sharded_state(self) -> checkpoint.ShardedState:
        return checkpoint.ShardedState(
            self.units,
            self._optimizer_set,
            self._opt_views,
            self.module,
            self.groups.everyone,  # every rank writes its file (all tensor positions too)
            self.stage,
            self.device,
            self._stored,
            self._model_names(),
            self._opt_state,
            self.groups.tensor.rank if self.groups.tensor is not None else 0,
        )

    def save_checkpoint(self, path: str | os.PathLike, client_state: dict | None = None) -> None:
        """Write a sharded checkpoint directory (collective: call on every rank). It loads
        at any world size and stage; `client_state` must load with weights_only=True."""
        self.wait_for_parameters()
        self.reducer.wait()
        self._settle_writes()
        checkpoint.save(
            self._sharded_state(),
            path,
            step=self.global_steps,
            compute_dtype=self.config.compute_torch_dtype,
            loss_scaler=self.scaler.state_dict(),
            client_state=client_state,
        )

    def load_checkpoint(
        self, path: str | os.PathLike, load_optimizer_states: bool = True
    ) -> dict | None:
        """Restore from a checkpoint written at any world size and stage (collective);
        returns the client state saved with it, if any. `load_optimizer_states=False`
        loads the model alone (evaluation, or fine-tuning with another optimizer)."""
        self.wait_for_parameters()
        for tier in (self._masters, self._shards):
            if tier is not None:
                tier.recover()  # every shard is written afresh
        if self._grads is not None:  # a load starts a step afresh: no gradient yet
            self._grads.recover()
            self.zero_grad()
        loaded = checkpoint.load(self._sharded_state(), path, load_optimizer_states)
        self.refresh_from_masters()
        if load_optimizer_states:
            self.scaler.load_state_dict(loaded.loss_scaler)
            self.global_steps = loaded.step
        self._memory.resync()  # the load may have created the optimizer state
        return loaded.client_state

    def load_pretrained(self, path: str | os.PathLike, strict: bool = True) -> dict[str, int]:
        """Load safetensors weights (a file, or Hugging Face shards with their index),
        each rank reading only its own ranges; the optimizer state is left as it is."""
        self.wait_for_parameters()
        read = load_pretrained(self.units, self.module, path, strict, self._stored)
        self.refresh_from_masters()
        return read

    def refresh_from_masters(self) -> None:
        """After the fp32 masters were written from outside (checkpoint, pretrained
        weights): rebuild the compute copies and the full parameters each rank holds."""
        self._publish_parameters()
        self.wait_for_parameters()

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The consolidated fp32 model (parameters from the masters, plus persistent
        buffers) in CPU memory, gathered one unit at a time, so the device never holds
        more than one unit of it; empty on other ranks when `rank0_only`."""
        self.wait_for_parameters()
        self._settle_writes()
        out: dict[str, torch.Tensor] = {}
        keep = not rank0_only or self.groups.global_rank == 0
        for unit in self.units:
            if not unit.layout.numel and not any(s.tensor_sharded for s in unit.layout.slots):
                continue  # (a block may be empty here and not at another position)
            for copy_index, full in self._full_copies(unit):
                for slot in unit.layout.slots:
                    if slot.tensor_sharded:  # every position's block (collective)
                        value = full_tensor(
                            full[slot.offset : slot.end].view(slot.shape),
                            slot.tensor,
                            self.groups.tensor,
                        )
                        for name in (slot.name, *slot.aliases) if keep else ():
                            out[name] = value
                        continue
                    if not keep:
                        continue
                    value = full[slot.offset : slot.end].to("cpu", copy=True)
                    for name in (slot.name, *slot.aliases):
                        stored = self._stored(unit, name, slot.shape, copy_index)
                        if tuple(stored.shape) == tuple(slot.shape):
                            out[stored.name] = value.view(slot.shape)
                            continue
                        # A batched expert weight: this copy's rows of the whole tensor.
                        whole = out.setdefault(
                            stored.name, torch.empty(stored.shape, dtype=value.dtype)
                        )
                        whole.view(-1)[stored.offset : stored.offset + slot.numel] = value
        if not keep:
            return {}
        for name, buf in checkpoint.persistent_buffers(self.module):
            out[name] = buf.detach().to("cpu", copy=True)
        return out

    def _gather_master(self, unit: FlatUnit) -> torch.Tensor:
        """The unit's full fp32 values (padded), identical across its shard group."""
        if self.stage == 0:
            with unit.master_resident():  # a copy of an offloaded one: it leaves after
                return unit.master.to(self.device, copy=unit.master_offloaded)
        full = torch.empty(unit.layout.padded_numel, dtype=unit.master_dtype, device=self.device)
        with unit.master_resident():
            unit.group.comm.all_gather(full, unit.master.to(self.device))
        return full

    def _full_copies(self, unit: FlatUnit) -> Iterator[tuple[int, torch.Tensor]]:
        """(copy index, full fp32 values) of each copy this rank needs to see: its own, or
        for distinct copies every one in turn (sent over the ranks at this rank's position
        in every copy), so that rank 0 ends with every expert."""
        full = self._gather_master(unit)
        group = unit.group
        if group.spec.replicated or group.replicas is None:
            yield group.copy_index, full
            return
        for copy_index in range(group.spec.copies):
            value = full if copy_index == group.copy_index else torch.empty_like(full)
            group.replicas.broadcast(value, src=copy_index)
            yield copy_index, value

    # ================================================================ lifecycle
    def close(self, wait: bool = True) -> None:
        """Finish the work in flight and destroy the engine's process groups (local, not
        a collective). Frameworks call it at teardown; dropping the engine does it too.
        Using the engine again re-creates them at its first collective (every rank takes
        part, as in any collective), or `reopen()` does it now. With `wait=False` (or when
        a wait fails because a peer is gone) the work in flight is dropped, not awaited;
        the groups are destroyed either way."""
        if self.groups.closed:
            return
        try:
            if wait:
                self.reducer.wait()
                # (a `.data` written since is adopted at the engine's next use, if any)
                self._finish_parameter_gathers()
                if self.gather is not None:
                    self.gather.release_all()
        finally:
            try:
                self.reducer.drop()
                if self.publisher is not None:
                    self.publisher.drop()
                if self.gather is not None:
                    self.gather.abandon()
            finally:
                self.groups.close()

    def __enter__(self) -> ZeroEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def release_module(self) -> nn.Module:
        """Hand the model back as a plain module, to shard it again with a new optimizer
        (Lightning's second `fit()`) or to use it without the engine: every parameter
        becomes a full tensor of its fp32 master values on this rank (this rank's experts
        for MoE layers), every hook the engine installed is removed and its groups are
        closed. Collective at stages 1-3 (the shards are gathered); the engine is done."""
        with contextlib.suppress(Exception):  # after an exception mid-step: finish or drop
            self.reducer.wait()
        self.reducer.drop()
        self.wait_for_parameters()
        if self.gather is not None:
            self.gather.release_all()
        with torch.no_grad():
            for unit in self.units:
                full = self._gather_master(unit)
                for slot, p, local in zip(unit.layout.slots, unit.params, unit.locals):
                    local.data = full[slot.offset : slot.end].view(slot.shape).clone()
                    match_local_dtype(p)
                    p.grad = None
        hooks = [self._handles, self.reducer.handles, self._module_state.handles]
        hooks += [self.gather.handles] if self.gather is not None else []
        hooks += [self.publisher.handles] if self.publisher is not None else []
        for handle in (h for group in hooks for h in group):
            handle.remove()
        for owner in (self.module, *self.optimizers):
            owner.__dict__.pop("zero_grad", None)  # the class's own zero_grad again
        self.close()
        self._store_finalizer()  # the offloaded state's file, closed (its space freed)
        for finalizer in self._tier_finalizers:
            finalizer()
        return self.module

    def reopen(self) -> None:
        """Re-create the process groups `close()` destroyed (collective: every rank)."""
        self.groups.reopen()

    @property
    def closed(self) -> bool:
        return self.groups.closed


# ==================================================================== helpers
def _coerce_config(config: ZeroConfig | dict | None) -> ZeroConfig:
    if config is None:
        return ZeroConfig()
    if isinstance(config, ZeroConfig):
        return config
    if isinstance(config, dict):
        return ZeroConfig.from_dict(config)
    raise TypeError(f"config must be a ZeroConfig or a dict, got {type(config).__name__}.")


def _optimizer_list(optimizer, cfg: ZeroConfig) -> list[torch.optim.Optimizer]:
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not optimizers:
        raise ValueError("ZeroEngine needs at least one optimizer; got an empty list.")
    if len(optimizers) > 1 and cfg.compute_torch_dtype == torch.float16:
        raise ValueError(
            "Several optimizers with fp16 are not supported: one dynamic loss scale cannot "
            "skip one optimizer's step and not the other's. Use bf16 (or fp32), or one "
            "optimizer with several param groups."
        )
    return optimizers


def _settle_expert_parallel(model, optimizer, ep_size: int) -> None:
    """MoE layers built with ep_size=None keep this rank's experts; the optimizer, built
    over every expert, forgets the others (and takes a batched weight's slice for it)."""
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    replaced = settle_expert_parallel(model, ep_size, rank, world)
    if replaced:
        for group in optimizer.param_groups:
            params = [replaced.get(id(p), p) for p in group["params"]]
            group["params"] = [p for p in params if p is not None]


def _resolve_device(params, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    for p in params:
        if not p.param.is_meta:
            return p.param.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _full_buffer_parts(unit: FlatUnit, groups: set[int]) -> list[torch.Tensor]:
    """`groups`' parts of the unit's full gradient buffer, if it has one: `.grad` at
    stages 0-1, the local sums under no_sync at 2-3."""
    if unit.grad_full is None:
        return []
    return [
        unit.grad_full[seg.start : seg.end]
        for seg in unit.layout.segments(0, unit.layout.numel)
        if seg.group_index in groups
    ]


def _shard_ranges(unit: FlatUnit, groups: set[int] | None) -> list[tuple[int, int]]:
    """The ranges of the unit's fp32 gradient shard (`grad_opt`) in `groups` (all when
    None), relative to the shard."""
    return [
        (seg.start - unit.opt_start, seg.end - unit.opt_start)
        for seg in unit.layout.segments(unit.opt_start, unit.opt_end)
        if groups is None or seg.group_index in groups
    ]


def _change_parts(
    change: Callable[[torch.Tensor], object],
    unit: FlatUnit,
    parts: list[tuple[int, int]] | None,
) -> None:
    """`change` on `parts` of `unit`'s gradient shard (all of it when None), which is in
    memory now (an offloaded one's views are made only then)."""
    if parts is None:
        change(unit.grad_opt)
        return
    for lo, hi in parts:
        change(unit.grad_opt[lo:hi])
