"""The optimizer side of ZeRO on one rank: the user's optimizers stepping this rank's
shards, and everything the step does around them.

It owns the shard views the optimizers hold (`OptimizerView`), their state's tier, the
loss scaler, the global gradient norm with clipping, the sharded EMA, the step itself
(fused or torch's own, whole or a tile at a time) and `zero_grad`. It does not gather,
reduce or publish: the engine waits for the reductions before calling it, and makes the
updated shards visible after it (`publish`).

The user's step hooks run exactly once per step. A whole step calls `optimizer.step()`,
which runs them. A step taken in tiles (offloaded state) runs the optimizer's own step
function over each tile without any hook (`private_api.step_without_hooks`) and the
hooks once around all the tiles: torch's process-global hook dicts are only read, never
swapped.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Protocol

import torch

from .. import private_api
from ..config import ZeroConfig
from ..offload import UnitTiers
from ..private_api import user_step_hooks
from ..units.flat_unit import FlatUnit, OneResident
from ..units.no_gradient import fill_no_gradient
from ..units.optimizer_view import OptimizerView
from .ema import ShardedEMA
from .fused_step import FusedAdamStep, Views
from .grad_norm import GradNorm
from .held_back import held_back, no_gradient_parts
from .loss_scaler import LossScaler
from .optimizer_set import OptimizerSet
from .state_dict_guard import guard_state_dicts
from .step_lag import StepLags


class GradMirror(Protocol):
    """Full-size copies of the gradients shown to the user (`keep_full_grads`): every
    change the step makes to the shards is made to them too."""

    def scale(self, factor: float, groups: set[int] | None = None) -> None: ...
    def clamp(self, limit: float, groups: set[int] | None = None) -> None: ...
    def cleared(self) -> set[int]: ...
    def changed(self) -> None: ...
    def hide(self, *, groups: set[int] | None = None) -> None: ...


class ShardedOptimizer:
    def __init__(
        self,
        config: ZeroConfig,
        units: Sequence[FlatUnit],
        stage: int,
        optimizer_set: OptimizerSet,
        views: list[OptimizerView],
        guards: list,
        fused: list[FusedAdamStep | None],
        state_store,
        norm: GradNorm,
        tiers: UnitTiers,
        mirror: GradMirror,
    ):
        self.config = config
        self.units = units
        self.stage = stage
        self.optimizer_set = optimizer_set
        self.optimizers = optimizer_set.optimizers
        self.views = views
        self.guards = guards  # the engine's direct-step guard on each optimizer (handles)
        # ... and every hook the engine put on the optimizers, to remove on release.
        self.handles = [*guards]
        # How far each parameter's step count is behind its group's (`step_lag`).
        self.step_lags = StepLags()
        for optimizer in self.optimizers:
            self.handles += guard_state_dicts(optimizer, views, stage, self.step_lags)
        self._fused = fused
        self.state_store = state_store  # where the optimizer's state lives
        self.norm = norm
        self._masters, self._shards, self._grads = tiers.masters, tiers.shards, tiers.grads
        self.mirror = mirror
        self.scaler = LossScaler(config)
        self.ema = ShardedEMA(views, optimizer_set.state)
        self.inside_step = False  # the engine's own optimizer.step() is running
        self._in_tile = False  # a step over one tile, run without hooks, is running
        self.grads_unscaled = False
        self.grads_live = False  # gradients since the last zero_grad
        # The parts of each view that no rank gave a gradient to since the last
        # zero_grad: put back after the step, as if skipped (`held_back`).
        self._held_back: dict[int, list[tuple[int, int]]] = {}
        self._groups_off: set[int] = set()  # param groups whose requires_grad is off
        # Param groups with no gradient since their last zero_grad() to None (or since the
        # start): a step skips them whole, as torch skips parameters whose .grad is None.
        self._gradless: set[int] = set(range(len(optimizer_set.param_groups)))
        self._norms: dict[tuple[int, ...] | None, torch.Tensor] = {}  # this step's

    # ---------------------------------------------------------------- what is where
    @property
    def masters_offloaded(self) -> bool:
        """Whether the masters (with the parameter shards, or in a tier of their own) are
        in files between steps: the step then brings them in unit by unit."""
        return self._shards is not None or self._masters is not None

    @property
    def stepped_in_parts(self) -> bool:
        """Whether the optimizers step a few views at a time (offloaded state or shards)."""
        return self.state_store.offloaded or self._shards is not None

    def offload_tiers(self) -> list:
        tiers = (self.state_store, self._masters, self._shards, self._grads)
        return [t for t in tiers if t is not None]

    def settle_in_background(self) -> None:
        """Let the last step's writes to the state's and the gradients' files finish
        without waiting: their buffers are given back as they do."""
        self.state_store.settle(wait=False)
        if self._grads is not None:
            self._grads.settle(wait=False)

    def recover_tiers(self) -> bool:
        """Before a load: the per-unit tiers forget a failed write (every shard is written
        afresh). Returns whether the gradient shards are offloaded (they must be zeroed:
        a load starts a step afresh)."""
        for tier in (self._masters, self._shards, self._grads):
            if tier is not None:
                tier.recover()
        return self._grads is not None

    def settle_writes(self) -> None:
        """Before the tiers' files are read whole (a save): every write is done, and one
        that failed makes the read refuse (the file is behind the training)."""
        for tier in self.offload_tiers():
            tier.settle(wait=True)
            if tier.failure is not None:
                tier.refuse()

    def chosen(self, optimizer) -> tuple[list[int], set[int] | None]:
        """Optimizer positions, and their param groups (None: every optimizer)."""
        if optimizer is None:
            return list(range(len(self.optimizers))), None
        k = self.optimizer_set.index_of(getattr(optimizer, "optimizer", optimizer))
        if len(self.optimizers) == 1:
            return [0], None
        return [k], set(self.optimizer_set.groups_of(k))

    # ---------------------------------------------------------------- gradients shown
    def expose_grads(self) -> None:
        """The optimizer's parameters' `.grad`: views of the gradient shards; None where
        the shard is offloaded (its memory is there only while it is in use) or its group
        holds no gradient (`_gradless`)."""
        for view in self.views:
            shown = view.unit.grad_home is None and view.group_index not in self._gradless
            view.param.grad = view.grad if shown else None

    def grads_arrived(self) -> None:
        """A synchronised backward ended: the reduced gradients are the optimizer's; the
        parameters no rank gave one to are noted, to be put back after the step."""
        self._held_back = no_gradient_parts(self.views)
        self._gradless.clear()
        self.expose_grads()
        self.grads_live = True

    def cleared_elsewhere(self) -> set[int] | None:
        """The param groups a zero_grad() that bypassed the engine cleared since backward
        (optimizer params, or at stages 0-1 model params, whose .grad went None); None
        when there are no live gradients."""
        if not self.grads_live:
            return None
        cleared = {
            v.group_index
            for v in self.views
            if v.param.grad is None and v.unit.grad_home is None  # offloaded: never shown
        }
        cleared |= self.mirror.cleared()
        if self.stage < 2:
            cleared |= {
                gi for u in self.units for s in u.param_grads.cleared_elsewhere() for gi in s.groups
            }
            if cleared:  # and the groups showing no gradient at all (unused parameters)
                live = {gi for u in self.units for gi in u.param_grads.live_groups()}
                cleared |= set(range(len(self.optimizer_set.param_groups))) - live
        return cleared

    def follow_requires_grad(self) -> None:
        """Lightning's `toggle_optimizer` switches requires_grad off on the other
        optimizers' parameters, which are the shard views: the model's own parameters
        follow, group by group, before each module's forward."""
        off = {v.group_index for v in self.views if not v.param.requires_grad}
        if off == self._groups_off:
            return
        self._groups_off = off
        for unit in self.units:
            for slot, p in zip(unit.layout.slots, unit.params):
                if slot.trainable:  # on while any optimizer holding it is on
                    p.requires_grad_(not off.issuperset(slot.groups))

    # ---------------------------------------------------------------- norm and clipping
    def unscale_and_measure(self, groups: set[int] | None = None) -> tuple[torch.Tensor, bool]:
        """The global grad norm (unscaled) of every param group or of `groups`, once per
        step, with the loss scale divided out of the gradients. The reductions must be
        done (the engine waits for them)."""
        key = None if groups is None else tuple(sorted(groups))
        if key in self._norms:
            return self._norms[key], False
        scale = 1.0 if self.grads_unscaled else self.scaler.scale
        norm = self.norm.global_norm(groups) / scale
        if not bool(torch.isfinite(norm)):
            return norm, True
        if scale != 1.0:
            self.scale_grads(1.0 / scale)
        self.grads_unscaled = True
        self._norms[key] = norm
        return norm, False

    def clip_grad_norm_(self, max_norm: float, optimizer=None) -> torch.Tensor:
        if max_norm <= 0:
            raise ValueError(f"max_norm must be positive, got {max_norm}.")
        _, groups = self.chosen(optimizer)
        norm, overflow = self.unscale_and_measure(groups)
        if not overflow:
            self._clip_to(max_norm, norm, groups)
        return norm

    def clip_grad_value_(self, clip_value: float, optimizer=None) -> None:
        if clip_value <= 0:
            raise ValueError(f"clip_value must be positive, got {clip_value}.")
        _, groups = self.chosen(optimizer)
        _, overflow = self.unscale_and_measure(groups)
        if not overflow:
            self.change_grads(groups, lambda grad: grad.clamp_(-clip_value, clip_value))
            self.mirror.clamp(clip_value, groups)

    def _clip_to(self, max_norm: float, norm: torch.Tensor, groups: set[int] | None) -> None:
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            self.scale_grads(coef, groups)

    def scale_left_in_grads(self) -> float:
        """The fp16 loss scale the gradients still carry (1 once unscaled, or without one)."""
        return 1.0 if self.grads_unscaled or not self.scaler.enabled else self.scaler.scale

    def scale_grads(self, factor: float, groups: set[int] | None = None) -> None:
        self.change_grads(groups, lambda grad: grad.mul_(factor))
        self.mirror.scale(factor, groups)

    def change_grads(
        self, groups: set[int] | None, change: Callable[[torch.Tensor], object]
    ) -> None:
        """`change` (in place, keeping zeros zero) on every gradient part of `groups` (or
        of all): at once, or with the shards offloaded, when each is next in memory."""
        self.mirror.changed()
        if self._grads is None:
            for grad in _grad_parts(self.units, groups):
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
                self.norm.forget(unit)
                parts = None if groups is None else ranges  # None: the whole shard
                unit.change_grads(functools.partial(_change_parts, change, unit, parts))

    # ---------------------------------------------------------------- the step
    def step(self, optimizer=None) -> tuple[bool, bool]:
        """One step of every optimizer, or of `optimizer` (its gradients clipped by their
        own norm). Returns (stepped, compute copies written): stepped is False when the
        step was skipped for an fp16 overflow."""
        chosen, groups = self.chosen(optimizer)
        for unit in self.units:  # a step with no backward before it reads no-gradient
            unit.prepare_grads()
        norm, overflow = self.unscale_and_measure(groups)
        if overflow:
            self.scaler.update(True)
            self.grads_unscaled = False
            return False, False
        if self.config.gradient_clipping > 0:
            self._clip_to(self.config.gradient_clipping, norm, groups)
        self.expose_grads()
        written = [True]  # whether every update also wrote the compute copies
        chosen_groups = {gi for k in chosen for gi in self.optimizer_set.groups_of(k)}
        stepped = chosen_groups - self._gradless
        chosen_views = [v for v in self.views if v.group_index in chosen_groups]
        state = self.optimizer_set.state
        # A step in one tile (state and shards in memory) is planned here: the user's
        # step hooks run around the whole step, with every gradient shown, where the
        # optimizer's own step does not see every slice: one taken in tiles, or one
        # with slices stepped by parts after it.
        one_tile = None
        if not self.stepped_in_parts:
            one_tile = self.step_lags.plan(chosen_views, self._held_back, state, stepped)
        hooks_outside = one_tile is None or bool(one_tile.by_parts)

        def step_tile(tile: list[OptimizerView]) -> None:
            held = self._held_back
            if self._grads is not None:  # offloaded gradient shards, in memory now
                held = {**held, **no_gradient_parts(tile, resident=True)}
            # Slices holding a parameter with no gradient, or one behind its group's
            # count, are stepped by parts after the optimizer's own step (`step_lag`).
            same = [id(v) for v in tile] == [id(v) for v in chosen_views]
            if one_tile is not None and held is self._held_back and same:
                plan = one_tile  # (planned above, with the same views and marks)
            else:
                plan = self.step_lags.plan(tile, held, state, stepped)
            put_back = plan.held_for_whole_steps()  # (by view id)
            with held_back(tile, put_back, state), plan.missed_by_first_steps(state):
                written[0] &= self._step_optimizers(
                    chosen, tile, plan.apart, put_back.keys(), hooks_outside
                )
            self.inside_step = True  # (a step() of a parent class the optimizer calls)
            try:
                plan.finish(state, self.optimizer_set.owner_of)
            finally:
                self.inside_step = False
            if self.config.ema_decay:
                self.ema.update(self.config.ema_decay, groups, tile)
            if self.masters_offloaded:  # while the masters are in memory
                for view in tile:
                    view.unit.sync_compute_from_master(view.lo, view.hi)

        # Views of `_gradless` groups go through the tiles too (the EMA follows every
        # step): their `.grad` is None (`expose_grads`), so the optimizer skips them.
        self._run_user_hooks(chosen, before=True, outside=hooks_outside)
        self.apply(chosen_views, step_tile, needs_grads=True)
        self.expose_grads()
        self._run_user_hooks(chosen, before=False, outside=hooks_outside)
        for k in chosen:  # an LR scheduler built on a ZeroRedundancyOptimizer watches it
            if (wrapper := self.optimizer_set.wrapper_of(k)) is not None:
                private_api.mark_stepped(wrapper)
        self.scaler.update(False)
        self.grads_unscaled = False
        self._norms.clear()
        return True, written[0] or self.masters_offloaded

    def _run_user_hooks(self, chosen: list[int], before: bool, outside: bool) -> None:
        """With the state offloaded, each optimizer's step runs in tiles, and a step with
        slices stepped by parts (`step_lag`) runs after the optimizer's own (`outside`):
        the user's step hooks run here instead, once, with every gradient in place, as
        around one `optimizer.step()` (torch's order: global then own pre-hooks, own then
        global post-hooks). A ZeroRedundancyOptimizer's own hooks always run here: the
        optimizer stepping for it has none."""
        hooks = []
        for k in chosen:
            facing = self.optimizer_set.facing[k]
            if outside or self.optimizer_set.wrapper_of(k) is not None:
                # Whole steps: `optimizer.step()` of the stepping one runs the global hooks.
                every = outside
                found = user_step_hooks(facing, self.guards[k].id, with_global=every)
                hooks += [(facing, hook) for hook in found[0 if before else 1]]
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
        groups = {gi for k in chosen for gi in self.optimizer_set.groups_of(k)}
        units = {v.unit.layout.index: v.unit for v in self.views if v.group_index in groups}
        with contextlib.ExitStack() as in_memory:
            for unit in units.values():
                if unit.grad_home is not None:
                    in_memory.enter_context(unit.grads_resident(modified=True))
                    self.norm.forget(unit)
            for view in self.views:
                shown = view.unit.grad_home is None or view.group_index in groups
                shown = shown and view.group_index not in self._gradless
                view.param.grad = view.grad if shown else None
            try:
                yield
            finally:
                self.expose_grads()

    def apply(
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
        if not self.masters_offloaded and not grads:
            self.state_store.apply(views, step)
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

            self.state_store.apply(views, run)

    def _step_optimizers(
        self,
        chosen: list[int],
        tile: list[OptimizerView],
        apart: set[int],
        put_back: Collection[int],
        hooks_outside: bool,
    ) -> bool:
        """Step the `chosen` optimizers over their views in `tile`: all of them, or with
        the state offloaded one tile at a time, the other views' gradients hidden so that
        the optimizer skips them. The views `apart` (by id) are skipped too: they are
        stepped by parts; the fused kernel steps the others. The views `put_back` (by id)
        are stepped whole and put back in part after (their first step), which the fused
        kernel's compute copies would not follow. With `hooks_outside`, no hook runs
        (`_run_user_hooks` runs those). Returns whether every update also wrote the
        compute copies (the fused kernel, with no view stepped by parts)."""
        partial = self.stepped_in_parts
        copies_written = True
        for k in chosen:
            opt, fused = self.optimizers[k], self._fused[k]
            groups = self.optimizer_set.groups_of(k)
            views = [v for v in tile if v.group_index in groups]
            if not views:
                continue
            if (
                not partial
                and fused is not None
                and not any(id(v) in put_back for v in views)
                and self._gradless.isdisjoint(groups)
                and fused.applies([v.param for v in views])
            ):
                fused.step(*self._fused_views(opt, leave_out=apart))
                copies_written &= not any(id(v) in apart for v in views)
                continue
            copies_written = False
            if partial:
                shown = {id(v) for v in views if v.group_index not in self._gradless}
                for view in self.views:
                    if view.group_index in groups:
                        view.param.grad = view.grad if id(view) in shown - apart else None
            hidden = [v for v in views if id(v) in apart and v.param.grad is not None]
            for view in hidden:
                view.param.grad = None
            self.inside_step, self._in_tile = True, partial
            try:
                if hooks_outside:
                    private_api.step_without_hooks(opt)
                else:
                    opt.step()
            finally:
                self.inside_step = self._in_tile = False
                for view in hidden:
                    view.param.grad = view.grad
        return copies_written

    def _fused_views(
        self, optimizer: torch.optim.Optimizer, leave_out: set[int]
    ) -> tuple[list[list[torch.Tensor]], list[list[Views]]]:
        """Per param group, in the group's order, but for the views `leave_out` (by id):
        the optimizer's params, and (master view, gradient view, the slice of the
        compute-dtype copy it must be written to, or None when that is the master)."""
        by_param = {}
        for view in self.views:
            if id(view) in leave_out:
                continue
            unit, lo, hi = view.unit, view.lo, view.hi
            if not unit.master_apart:
                copy = None
            elif self.stage < 3:
                copy = unit.full[unit.opt_start + lo : unit.opt_start + hi]
            else:
                copy = unit.shard[lo:hi]
            by_param[id(view.param)] = (view.param.detach(), view.param.grad, copy)
        params = [[p for p in g["params"] if id(p) in by_param] for g in optimizer.param_groups]
        return params, [[by_param[id(p)] for p in group] for group in params]

    def guard_direct_step(self, optimizer, args, kwargs) -> None:
        """A step pre-hook on each managed optimizer: its own `step()` called by the user
        would skip the reduction, the clipping and the publishing."""
        if self._in_tile:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() calls another optimizer class's step() "
                "(super().step()), which runs the step hooks again for every tile of a step "
                "taken in tiles (offload_optimizer='disk' or offload_params='disk'). Define "
                "its update in one step() that does not call a hooked step, or turn the "
                "offload off."
            )
        if not self.inside_step:
            raise RuntimeError(
                "optimizer.step() was called directly on an optimizer managed by ZeroEngine: "
                "gradients would not be reduced or clipped and the parameters would not be "
                "re-gathered. Call engine.step() instead."
            )

    # ---------------------------------------------------------------- zero_grad
    def given_grads(self, groups: set[int] | None = None) -> list[torch.Tensor]:
        """Stages 2-3: the parts of the gradient shards in memory (of `groups`, or all)
        that some rank gave a gradient since `zero_grad()` (the rest is held back, found
        when the backward ended): what `zero_grad(set_to_none=False)` zeroes, as torch
        zeroes a `.grad` that exists, where a None one (DDP's for an unused parameter)
        stays None."""
        if self.stage < 2:
            return []
        out = []
        for view in self.views:
            if view.grad is None or view.unit.grad_home is not None:
                continue
            if groups is not None and view.group_index not in groups:
                continue
            start = 0
            for lo, hi in sorted(self._held_back.get(id(view), ())):
                out.append(view.grad[start:lo])
                start = hi
            out.append(view.grad[start:])
        return out

    def zero_grad(self, optimizer=None, set_to_none: bool = True) -> bool:
        """Zero the gradient shards of `optimizer`'s groups here; returns True when every
        group is to be zeroed (the engine then also zeroes the reducer's buffers). One
        optimizer's of several: only its parameters' `.grad` go None (or read zeros, which
        its step takes as a gradient, as torch's); the others' stay shown."""
        _, groups = self.chosen(optimizer)
        self.mirror.hide(groups=groups if set_to_none else None)  # (zeros: shown after)
        self._norms.clear()
        if groups is not None:
            given = [] if set_to_none else self.given_grads(groups)
            self.zero_groups(groups, to_none=set_to_none, zeros=given)
            for unit in self.units if self.stage < 2 else ():
                if unit.grad_full is not None and set_to_none:
                    unit.param_grads.hide(groups)
                elif unit.grad_full is not None:
                    unit.param_grads.zero_shown(groups)
            if not set_to_none and self.stage < 2:
                self._recount_held_back()  # (the zeros shown are gradients now)
            return False
        self.norm.clear()
        for view in self.views:
            view.param.grad = None
        self.grads_unscaled = False
        self.grads_live = False
        if set_to_none:
            self._held_back = {}
            self._gradless = set(range(len(self.optimizer_set.param_groups)))
        # (else the parts no rank gave a gradient stay held back: None under torch)
        return True

    def honour_cleared_elsewhere(self, zero_all: Callable[[], None]) -> None:
        """A zero_grad() that bypassed the engine: every group cleared is the engine's
        `zero_all` (its reductions too), some (one optimizer's of several) theirs alone."""
        cleared = self.cleared_elsewhere()
        if not cleared:
            return
        if cleared >= set(range(len(self.optimizer_set.param_groups))):
            zero_all()
        else:
            self.zero_groups(cleared)

    def zero_groups(
        self, groups: set[int], to_none: bool = True, zeros: Sequence[torch.Tensor] = ()
    ) -> None:
        """The gradients of `groups` go: to "no gradient" (`to_none`: until a backward
        brings new ones, a step skips those groups), or to real zeros over `zeros` (the
        parts some rank gave a gradient, `given_grads`), which a step takes as one."""
        if to_none:
            self._gradless |= groups
        self.change_grads(groups, fill_no_gradient)
        for piece in zeros:
            piece.zero_()
        for view in self.views:  # (zeros stay exposed: not taken for an outside clear)
            if view.group_index in groups:
                shown = not to_none and view.unit.grad_home is None
                view.param.grad = view.grad if shown else None
        self._recount_held_back()

    def _recount_held_back(self) -> None:
        """A parameter that another optimizer steps too has no gradient for it now (its
        one .grad is None in one process): that optimizer's step holds it back."""
        if any(view.alias_of is not None for view in self.views):
            self._held_back = no_gradient_parts(self.views)

    # ---------------------------------------------------------------- EMA
    def update_ema(self, decay: float, first_step_taken: bool) -> None:
        if not first_step_taken and not self.ema.started:
            raise RuntimeError(
                "update_ema() before the first step: the EMA starts from trained weights "
                "(and an optimizer's state is created by its first step). Call it after "
                "engine.step()."
            )
        self.apply(
            self.views, lambda tile: self.ema.update(decay, None, tile), changes_weights=False
        )

    def swap_ema(self) -> None:
        if not self.ema.started:
            self.ema.swap()  # raises, naming the fix
        self.apply(self.views, self.ema.swap)


def _grad_parts(units: Sequence[FlatUnit], groups: set[int] | None) -> list[torch.Tensor]:
    """The gradient tensors of every param group (or of `groups`), each element once:
    the optimizer's slices, and at stages 0-1 the full buffers `.grad` views."""
    if groups is None:
        return [grad for unit in units for grad in unit.grad_buffers()]
    parts = []
    for unit in units:
        if unit.grad_opt is None:
            continue
        parts += _full_buffer_parts(unit, groups)
        buffers = unit.grad_buffers()
        if not (len(buffers) == 1 and buffers[0] is unit.grad_full):  # not a view of it
            parts += [unit.grad_opt[lo:hi] for lo, hi in _shard_ranges(unit, groups)]
    return parts


def _full_buffer_parts(unit: FlatUnit, groups: set[int]) -> list[torch.Tensor]:
    """`groups`' parts of the unit's full gradient buffer, if it has one: `.grad` at
    stages 0-1, the local sums under no_sync at 2-3."""
    if unit.grad_full is None:
        return []
    return [
        unit.grad_full[seg.start : seg.end]
        for seg in unit.layout.segments(0, unit.layout.numel, groups)
    ]


def _shard_ranges(unit: FlatUnit, groups: set[int] | None) -> list[tuple[int, int]]:
    """The ranges of the unit's fp32 gradient shard (`grad_opt`) in `groups` (all when
    None), relative to the shard."""
    return [
        (seg.start - unit.opt_start, seg.end - unit.opt_start)
        for seg in unit.layout.segments(unit.opt_start, unit.opt_end, groups)
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
