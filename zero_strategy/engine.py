"""`ZeroEngine`: the sharded training state of one model on one rank, behind one facade.

    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3))
    loss = engine.module(batch)   # the user's module, hooks installed; forward unchanged
    engine.backward(loss)         # loss scaling (fp16); reductions overlap backward
    engine.step()                 # wait comms, unscale, global-norm clip, inner step
    engine.zero_grad()

The facade owns no tensors. Its parts, put together in order by `builder.steps`:
- the units (`units.flat_unit`), one per layout (`layout.partition`), each holding its
  shards, gather buffer and gradient buffers;
- the schedule: stage 3's gathers (`units.gather`), stages 1-2's post-step gathers
  (`units.publish`), the gradient reductions (`units.grads`);
- the sharded optimizer (`optim.sharded_optimizer`): step, norm, clipping, EMA;
- the state door (`checkpoint.state_door`): checkpoints, pretrained weights, state dicts;
- what the user's model shows (`model_view`): full parameters and gradients on demand,
  `state_dict()` hooks, `.data` writes adopted;
- the memory account (`memory.account`).
`docs/architecture.md` follows one unit through one step.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .builder import steps, wiring
from .builder.materialise import materialise
from .builder.meta_init import InitFn
from .checkpoint.state_door import StateDoor
from .comm import shutdown
from .config import ZeroConfig
from .layout.shard_spec import PlacementFn
from .memory.account import MemoryAccount, Sources
from .model_view.buffers import BufferSync
from .model_view.full_view import FullGrads, FullParameters
from .model_view.grad_face import GradReads
from .model_view.module_state import ModuleStateHooks
from .model_view.parameter_reads import ParameterReads
from .model_view.replaced_data import ReplacedDataWatch
from .offload import agree_on_write_failures
from .optim.sharded_optimizer import ShardedOptimizer
from .private_api import in_backward
from .units.grads import refuse_a_step_over_local_sums
from .units.schedule import UnitSchedule


class ZeroEngine:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
        config: ZeroConfig | dict | None = None,
        *,
        device: torch.device | str | None = None,
        param_init_fn: InitFn | None = None,
        placement: PlacementFn | None = None,
        device_mesh: Any = None,
    ):
        """`placement(module_path, module)` may return a `ShardSpec` for a module whose
        parameters are sharded over groups other than the whole world (None elsewhere).
        The experts of `zero_strategy.moe.MoE` layers are placed on their
        expert-data-parallel groups whatever it says.

        Several optimizers over disjoint parameter sets (a GAN's) are each sharded, and
        step on their own: `step(optimizer)`, `optimizer.zero_grad()`. With None, a model
        that is only run (a frozen reference model, a teacher) is sharded all the same,
        holding no gradient or optimizer state for its frozen parameters.

        Tensor parallelism: apply torch's plan (`parallelize_module`) on the tensor
        dimension of a 2-D (data, tensor) `device_mesh` and pass that mesh, or set
        `ZeroConfig.tensor_parallel_size` (contiguous tensor groups). ZeRO then shards over
        the data dimension only (`zero_strategy.tensor_parallel`)."""
        prepared = steps.prepare(model, optimizer, config, device, device_mesh)
        model, self._runner = prepared.module, prepared.runner  # out of a compiled wrapper
        self.config, self.device, self.module = prepared.config, prepared.device, model
        self.optimizers = prepared.optimizer_set.facing  # the user's objects
        self.optimizer = self.optimizers[0]
        experts, homes = self._assemble_units(model, prepared, placement, param_init_fn)
        tiers = self._assemble_optimizer_side(model, prepared, homes)
        self._door = StateDoor(
            self.units,
            model,
            prepared.optimizer_set,
            self.optim.views,
            self.optim.state_store,
            self.groups,
            self.stage,
            self.device,
            steps.tensor_sharded(prepared.params),
            experts.names,
            self.optim.step_lags,
        )
        hooks = (self.zero_grad, self.before_forward, self.after_forward)
        calls = wiring.EngineCalls(
            *hooks, self.optim.follow_requires_grad, self.schedule.gather_for_read
        )
        reads = self._reads if self.gather is not None else None  # stage 3 only
        self._handles = [
            *self.optim.handles,
            *wiring.wire_model(model, self.optimizers, self.units, calls, reads),
        ]
        self._backward_pending = False
        self.global_steps = 0
        self.reset_comm_report()
        watched = (self.units, self.optim, self.schedule, tiers, self.staging, model)
        self._memory.watch(Sources(*watched, self.stage, self.device, self._host))

    def _assemble_units(self, model, prepared, placement, param_init_fn):
        """Builder steps 1-6: the groups, the homes, the experts' placement, the layouts,
        the units and their initial values (see `builder/steps.py`)."""
        cfg = self.config
        self.groups = steps.process_groups(cfg, self.device, prepared.world)  # 1
        steps.check_mesh(model, cfg, self.groups)  # 2
        # Dropping the engine (with its module) destroys its groups; so does close().
        self._finalizer = weakref.finalize(self, self.groups.close)
        shutdown.close_at_exit(self)  # still alive when the script ends: close() first
        homes = steps.where_things_live(cfg, self.device, self.world_size)  # 3
        self.stage, self._host = homes.stage, homes.host
        experts, groups_of = steps.place_experts(
            model, prepared, placement, self.groups, self.stage
        )
        layouts = steps.layouts(  # 4
            model, cfg, self.stage, self.world_size, prepared.params, groups_of, experts.placed
        )
        self.units = steps.units(  # 5
            model, layouts, homes, self.groups, self.device, cfg.compute_torch_dtype
        )
        awaited = materialise(  # 6
            model,
            self.units,
            self.stage,
            self.device,
            self.groups.tensor,
            param_init_fn,
            prepared.params,
        )
        self._buffers = BufferSync(
            model, self.groups.world.comm, self.device, cfg.broadcast_buffers, awaited.check
        )
        self._buffers.sync()  # as DDP at construction, whatever broadcast_buffers says
        return experts, homes

    def _assemble_optimizer_side(self, model, prepared, homes):
        """Builder steps 7-8: the optimizers over this rank's shards, the schedule that
        reduces into them, the disk tiers, the model's views, the sharded optimizer."""
        cfg = self.config
        self._memory = MemoryAccount()
        side = steps.optimizer_side(prepared, self.units, homes, self.groups, self._memory.sample)
        self._store_finalizer = weakref.finalize(self, side.state_store.closer())
        self.fused_step = side.fused[0]
        self._replaced = ReplacedDataWatch(
            self.units,
            self.stage,
            cfg.compute_torch_dtype,
            lambda: self.schedule.finish_publishing(),  # (made next)
        )
        self._reads = ParameterReads(self._replaced)  # writes to what a read gathered too
        self.schedule = UnitSchedule(
            model,
            self.units,
            self.stage,
            cfg,
            self.groups,
            self._memory.sample,
            side.norm.note_landed,
            self._on_backward_end,
            written=self._reads,
            on_masters_changed=self._reads.drop_unwritten,  # freed unwritten: old values
        )
        self.staging, tiers = steps.disk_tiers(  # 8
            cfg, self.units, self.stage, self.groups.global_rank, self._memory.sample
        )
        self.tiers = tiers
        self._tier_finalizers = [weakref.finalize(self, t.closer()) for t in tiers.present()]
        self._module_state = ModuleStateHooks(
            model, self.units, self.gather, self.wait_for_parameters
        )
        self._full_parameters = FullParameters(
            self.units,
            self.gather,
            self.wait_for_parameters,
            self.groups.mesh,
            self.groups.tensor,
            self._replaced.adopt_unit,
        )
        self.grad_reads = _grad_reads_of(self)
        owner = self._module_state.owner
        self._full_grads = FullGrads(self.units, self.stage, self.gather, owner, self.grad_reads)
        guards = [o.register_step_pre_hook(self._guard_direct_step) for o in self.optimizers]
        self.optim = ShardedOptimizer(
            cfg,
            self.units,
            self.stage,
            prepared.optimizer_set,
            side.views,
            guards,
            side.fused,
            side.state_store,
            side.norm,
            tiers,
            self._full_grads,
        )
        return tiers

    # ================================================================ properties
    @property
    def world_size(self) -> int:
        """Data-parallel ranks (the processes of the default group, or with tensor
        parallelism the ranks at this rank's tensor-parallel position)."""
        return self.groups.world_size

    @property
    def tensor_parallel_size(self) -> int:
        return self.groups.mesh.tensor_size

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def reducer(self):
        """The gradient reductions (`units.grads.GradReducer`)."""
        return self.schedule.reducer

    @property
    def gather(self):
        """Stage 3's gathers (`units.gather.GatherManager`); None at stages 0-2."""
        return self.schedule.gather

    @property
    def scaler(self):
        """The fp16 loss scaler (disabled in other precisions)."""
        return self.optim.scaler

    @property
    def in_step(self) -> bool:
        """A training forward ran and its backward has not yet: the caller is inside a
        training step (so `unshard()` there would only hold memory backward needs)."""
        return self._backward_pending

    @property
    def closed(self) -> bool:
        return self.groups.closed

    # ================================================================ backward's end
    def _on_backward_end(self) -> None:
        """The schedule's call once a synchronised backward's reductions are in."""
        # Expose the gradients to the optimizer params: a zero_grad() that bypasses the
        # engine (an optimizer wrapper calling Optimizer.zero_grad) shows up as None here.
        self.optim.grads_arrived()
        self._backward_pending = False
        self._full_grads.show_after_backward(self.reducer, self.config.keep_full_grads)

    def _guard_direct_step(self, optimizer, args, kwargs) -> None:
        self.optim.guard_direct_step(optimizer, args, kwargs)

    # ================================================================ forward
    def before_forward(self) -> None:
        """Runs before every forward of the root module. A framework that runs the model
        through a method other than the root's forward (Lightning's training_step) calls
        it, and `after_forward`, itself, as DDP's forward redirection does."""
        self.honour_outside_zero_grad()
        self._replaced.look(training=torch.is_grad_enabled())
        self.optim.settle_in_background()  # the last step's writes: their buffers go
        self._full_grads.hide(faces=torch.is_grad_enabled())  # a backward may follow
        self.reducer.hooks.rehook_converted()
        self._buffers.before_forward()

    def begin_step(self) -> None:
        """What the root module's forward pre-hooks do, for a framework that runs the
        user's step (Lightning's `training_step`, `test_step`) instead of the root's
        forward: `before_forward`, and at stage 3 the root unit gathered, so that the root
        module's own parameters read directly in the step (`self.layer.weight.item()`) are
        whole, as they are inside the root's forward (and under DDP). Pair it with
        `after_forward`; an evaluation step then `reshard()`s."""
        self.before_forward()
        self.schedule.begin_step()

    def after_forward(self, output: Any = None) -> None:
        """As DDP: a forward followed by a synchronised backward may have changed buffers
        (BatchNorm statistics); the next forward, of any kind, starts from rank 0's.
        Evaluation and no_sync() forwards leave them as they are. The backward through
        `output` (the forward's, or the framework's step's) is watched from its start."""
        if not in_backward():
            self._buffers.after_forward(torch.is_grad_enabled() and self.reducer.sync)
            self._backward_pending = torch.is_grad_enabled()
            if torch.is_grad_enabled():
                self.reducer.watch_outputs(output)

    def honour_outside_zero_grad(self) -> None:
        """Honour a zero_grad() that did not come through the engine: optimizer params
        (or, at stages 0-1, model params) whose .grad was set to None since backward. The
        next forward and backward call it; a framework whose steps may end with such a
        zero_grad (Lightning's manual optimization) calls it then, so that the model's
        `.grad` reads None afterwards, as under DDP."""
        self.optim.honour_cleared_elsewhere(self.zero_grad)

    # ================================================================ training API
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._runner(*args, **kwargs)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward with the fp16 loss scale applied; reductions run during it."""
        self.scale_loss(loss).backward(**kwargs)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Prepare for a backward the caller runs: finish parameter gathers, honour an
        outside zero_grad(), and return the loss times the fp16 loss scale."""
        self.wait_for_parameters()
        self.honour_outside_zero_grad()
        self._full_grads.hide()
        scaler = self.optim.scaler
        return loss * scaler.scale if scaler.enabled else loss

    def unshard(self) -> None:
        """Stage 3: gather every unit and keep it gathered until the module's next use
        frees it (its forward, the next step, or `reshard()`): the whole model readable
        outside forward, as an unwrapped DDP model is, at the cost of holding all of it.
        Collective. Writes to it are not kept; use `gathered_parameters()` to write."""
        if self.gather is None:
            self.wait_for_parameters()
            return
        self.schedule.make_all_whole()

    def reshard(self) -> None:
        """Stage 3: free every gathered unit now (e.g. after an evaluation batch that
        did not go through the root module's forward). The spare gather buffers kept for
        reuse (one per unit size) stay."""
        self.schedule.release_all()

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
        self.reducer.wait()
        return self.optim.clip_grad_norm_(max_norm, optimizer)

    def clip_grad_value_(
        self, clip_value: float, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Clamp every gradient element (of `optimizer`'s parameters, when given) to
        [-clip_value, clip_value]: elementwise, so exact on shards."""
        self.reducer.wait()
        self.optim.clip_grad_value_(clip_value, optimizer)

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """One optimizer step over this rank's shards, then refresh the compute copies:
        every optimizer's, or only `optimizer`'s (its own gradients clipped by their own
        norm, as `clip_grad_norm_` over its parameters would). Returns False when the step
        was skipped for an fp16 overflow."""
        refuse_a_step_over_local_sums(self.stage, self.reducer.holds_local_sums)
        if self.optim.stepped_in_parts:  # a write of the last step failed on some rank
            agree_on_write_failures(self.optim.offload_tiers(), self.groups.everyone)
        self.wait_for_parameters()
        self.reducer.wait()
        stepped, copies_written = self.optim.step(optimizer)
        if not stepped:
            self.zero_grad()
            return False
        self._memory.resync()  # the first step creates the optimizer state
        if self.stage == 3:  # the parameters the full gradients belong to are re-sharded
            self._full_grads.hide(faces=False)
        # The fused kernel wrote the compute copies in the same pass.
        self.schedule.publish(copies_written=copies_written, after_step=True)
        self.global_steps += 1
        return True

    def zero_grad(
        self, set_to_none: bool = True, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Zero the gradients: all, or `optimizer`'s (what its own `zero_grad()` does).
        `.grad` reads None, or with `set_to_none=False` zeros where it showed a gradient,
        which the step takes as one (torch's); the buffers stay allocated."""
        self.reducer.wait()
        showed = self.optim.grads_live and not set_to_none
        given = self.optim.given_grads() if showed else []
        if self.optim.zero_grad(optimizer, set_to_none):
            self.reducer.zero_grad(set_to_none, real_zeros=given)
        if showed:  # stages 2-3: the faces again, over the zeroed shards
            self._full_grads.show_after_backward(self.reducer, self.config.keep_full_grads)

    # ================================================================ EMA
    def update_ema(self, decay: float) -> None:
        """Fold the current weights into the sharded EMA (the first call copies them):
        `ema += (1 - decay) * (weights - ema)`, on this rank's shards only (local). Held
        in the optimizer state, so checkpoints save it and load it at any world size."""
        self.optim.update_ema(decay, first_step_taken=self.global_steps > 0)

    @property
    def ema_started(self) -> bool:
        """Whether the sharded EMA holds an average yet (after its first update)."""
        return self.optim.ema.started

    def swap_ema(self) -> None:
        """Exchange the weights and their EMA (a second call undoes it); the compute
        copies follow. Collective at stages 1-3 (the parameters are re-gathered)."""
        self.wait_for_parameters()
        self.optim.swap_ema()
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

    # ================================================================ reading the model
    def parameter_numel(self, param: torch.Tensor) -> int:
        """Elements of `param` in the full model, also while stage 3 holds it freed (for
        summaries and counts that would otherwise read 0)."""
        owned = self._module_state.owner.get(id(param))
        return owned[1].numel if owned is not None else param.numel()

    def manages(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is one of the model's parameters or one of the optimizer's
        shard views (what `clip_grad_norm_(optimizer params)` style calls hand over)."""
        return id(tensor) in self._module_state.owner or any(
            tensor is v.param for v in self.optim.views
        )

    def parameter_names(self) -> set[str]:
        """Every name (tied aliases included) under which the model holds a parameter."""
        return self._door.parameter_names()

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
        return self._full_grads.grad(param, self.optim.scale_left_in_grads())

    def full_grads(self, module: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The full reduced gradients of `module`'s trainable parameters (the whole model
        when None), by name, each unit gathered once. Collective (every rank)."""
        self.reducer.wait()
        module = module if module is not None else self.module
        return self._full_grads.grads_of(module, self.optim.scale_left_in_grads())

    def wait_for_parameters(self) -> None:
        """Finish the post-step parameter gathers (stages 1-2), and take in `.data` written
        since (and at stage 3 the writes to units a read gathered), before the full
        parameters are read or written outside the module's forward: a checkpoint, a
        state dict, a step."""
        self.schedule.finish_publishing()
        self._replaced.look()
        self._reads.write_back()

    # ================================================================ reports
    def memory_report(self) -> dict[str, int]:
        """Exact bytes held by this rank, by kind, and (`peak_<kind>`, `peak_total`) the
        most held at once since `reset_memory_peaks()` (or since the engine was built)."""
        return self._memory.report()

    def reset_memory_peaks(self, record_timeline: bool = False) -> None:
        """Start the `peak_*` figures of `memory_report()` over from what is held now.
        With `record_timeline`, also keep every change until the next reset (see
        `memory_timeline()`), for plots of a step."""
        self._memory.peaks.reset(record_timeline)

    def memory_timeline(self) -> list[tuple[float, dict[str, int]]]:
        """(time.perf_counter(), bytes by kind) at every change since
        `reset_memory_peaks(record_timeline=True)`; empty when none was requested."""
        return self._memory.timeline()

    def comm_report(self) -> dict[str, dict[str, int]]:
        """Bytes, calls and bytes received within/across nodes per collective kind since
        the last `reset_comm_report()`, over this rank's groups (`comm/nodes.py`)."""
        return self.groups.comm_report()

    def reset_comm_report(self) -> None:
        self.groups.reset_comm_report()

    # ================================================================ state
    def save_checkpoint(
        self,
        path: str | os.PathLike,
        client_state: dict | None = None,
        *,
        one_file: bool = False,
        keys: dict | None = None,
    ) -> None:
        """Write a sharded checkpoint directory (collective: call on every rank). It loads
        at any world size and stage; `client_state` must load with weights_only=True.
        `one_file`: one torch file instead, as Lightning's checkpoints are (every rank
        writes its own ranges of it); `keys`: Fabric's names for the model and optimizers
        in it (Lightning's layout when None)."""
        self.wait_for_parameters()
        self.reducer.wait()
        self.optim.settle_writes()
        meta = dict(
            step=self.global_steps,
            compute_dtype=self.config.compute_torch_dtype,
            loss_scaler=self.optim.scaler.state_dict(),
            client_state=client_state,
        )
        self._door.save(path, one_file=one_file, keys=keys, **meta)

    def load_checkpoint(
        self, path: str | os.PathLike, load_optimizer_states: bool = True
    ) -> dict | None:
        """Restore from a checkpoint written at any world size and stage (collective);
        returns the client state saved with it, if any. `load_optimizer_states=False`
        loads the model alone (evaluation, or fine-tuning with another optimizer)."""
        self.wait_for_parameters()
        if self.optim.recover_tiers():  # a load starts a step afresh: no gradient yet
            self.zero_grad()
        loaded = self._door.load(path, load_optimizer_states)
        self.refresh_from_masters()
        if load_optimizer_states:
            if loaded.loss_scaler:  # (another writer's one file has none)
                self.optim.scaler.load_state_dict(loaded.loss_scaler)
            self.global_steps = loaded.step
        self._memory.resync()  # the load may have created the optimizer state
        return loaded.client_state

    def load_pretrained(
        self, path: str | os.PathLike, strict: bool = True, into: str | None = None
    ) -> dict[str, int]:
        """Load safetensors weights (a file, or Hugging Face shards with their index),
        each rank reading only its own ranges; the optimizer state is left as it is.
        `into`: the submodule they are the weights of (default: the model, or the
        outermost Transformers model inside it)."""
        self.wait_for_parameters()
        read = self._door.load_pretrained(path, strict, into)
        self.refresh_from_masters()
        return read

    def refresh_from_masters(self) -> None:
        """After the fp32 masters were written from outside (checkpoint, pretrained
        weights): rebuild the compute copies and the full parameters each rank holds."""
        self.schedule.publish()
        self.wait_for_parameters()

    def full_state_dict(
        self, rank0_only: bool = True, trainable_only: bool = False
    ) -> dict[str, torch.Tensor]:
        """The consolidated fp32 model (parameters from the masters, plus persistent
        buffers) in CPU memory, gathered one unit at a time, so the device never holds
        more than one unit of it; empty on other ranks when `rank0_only`. With
        `trainable_only`, only what the optimizer trains (a LoRA adapter, for PEFT's
        `save_pretrained(state_dict=...)`), gathering nothing of a frozen base."""
        self.wait_for_parameters()
        self.optim.settle_writes()
        return self._door.full_state_dict(rank0_only, trainable_only)

    def full_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer | None = None, rank0_only: bool = True
    ) -> dict[str, Any]:
        """`optimizer`'s whole state (any of the engine's; with one, it may be left out)
        as torch's `state_dict()` of it unsharded, in CPU memory, assembled one parameter
        at a time; empty on other ranks when `rank0_only`. Collective."""
        self.wait_for_parameters()
        self.optim.settle_writes()
        return self._door.full_optimizer_state(optimizer, rank0_only)

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
            if wait:  # (a `.data` written since is adopted at the engine's next use, if any)
                self.schedule.settle()
        finally:
            try:
                self.schedule.drop()
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
        self._full_grads.hide()  # the shards the faces read go with the engine
        self.wait_for_parameters()
        self.schedule.release_all()
        self._door.hand_back()
        for handle in (*self._handles, *self.schedule.handles, *self._module_state.handles):
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


def _grad_reads_of(engine: ZeroEngine) -> GradReads:
    """What the sharded `.grad` faces ask of the engine, held weakly: a `.grad` the model
    keeps must not keep a dropped engine (and its process groups) alive."""
    ref = weakref.ref(engine)

    def live() -> ZeroEngine:
        found = ref()
        if found is None:
            raise RuntimeError(
                "This .grad belongs to a ZeroEngine that has been dropped. Read gradients "
                "(or copy them: p.grad.clone() on every rank) while the engine lives, or set "
                "p.grad = None."
            )
        return found

    return GradReads(
        wait=lambda: live().reducer.wait(),
        scale_left=lambda: live().optim.scale_left_in_grads(),
    )
