"""When units are made whole, released and reduced: one object for the engine to call.

A unit is made whole in one of two ways, by stage:
- stages 1-2 keep every unit whole; after each step the updated shards are all-gathered
  back (`publish.ParameterPublisher`), overlapping the next forward;
- stage 3 gathers a unit just before its use and frees it after
  (`gather.GatherManager`), prefetching in the recorded order, with the ranks' paths
  checked (`order_check`).
Either way the gradients are reduced as backward produces them (`grads.GradReducer`).
This object wires the three together (a unit's gradients in lets stage 3 free it; the end
of backward releases what is left) and gives the engine one vocabulary for both stages:
`publish`, `finish_publishing`, `make_all_whole`, `release_all`. It decides when; the
units do the tensor work.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..comm.topology import ProcessGroups
from ..config import ZeroConfig
from ..layout.partition import select_unit_modules
from .flat_unit import FlatUnit
from .gather import STATE_DICT, GatherManager, WrittenValues
from .grads import GradReducer
from .publish import ParameterPublisher


class UnitSchedule:
    def __init__(
        self,
        model: nn.Module,
        units: list[FlatUnit],
        stage: int,
        cfg: ZeroConfig,
        groups: ProcessGroups,
        on_memory: Callable[[], None],
        on_grads_landed: Callable[[FlatUnit], None],
        on_backward_end: Callable[[], None],
        written: WrittenValues | None = None,
        on_masters_changed: Callable[[], None] = lambda: None,
    ):
        self.units = units
        self._on_backward_end = on_backward_end  # the engine's: the gradients are in
        self._on_masters_changed = on_masters_changed
        self.reducer = GradReducer(
            units,
            stage,
            cfg.overlap_comm,
            cfg.reduce_torch_dtype if cfg.reduce_dtype is not None else None,
            on_unit_ready=self._unit_grads_ready,
            on_backward_end=self._backward_ended,
            on_memory=on_memory,
            before_reduction=self._check_paths,
            before_backward_end=self._check_backward_path,
            on_grads_landed=on_grads_landed,
            exchange=lambda value: groups.world.comm.control_all_gather_json(
                value, units[0].device
            ),
            hold_reductions=lambda: self.gather is not None and self.gather.paths_diverged,
            not_run=lambda: self.gather.not_run() if self.gather is not None else set(),
            reach=lambda position: self.gather is not None and self.gather.reach(position),
        )
        self.publisher = (
            ParameterPublisher(
                model,
                units,
                cfg.overlap_param_gather,
                select_unit_modules(model, cfg.unit_module_classes),
            )
            if stage in (1, 2)
            else None
        )
        self.gather: GatherManager | None = None
        if stage == 3:
            self.gather = GatherManager(
                model,
                units,
                groups.order_tags() if cfg.verify_module_order else None,
                cfg.prefetch_depth,
                cfg.persistence_threshold,
                cfg.max_reuse_distance,
                on_backward_start=self.reducer.backward_started,
                on_memory=on_memory,
                finish_reductions=self.reducer.finish_sent,
                release_reductions=self.reducer.release_through,
                written=written,
            )

    @property
    def handles(self) -> list:
        """Every hook the schedule installed on the model."""
        hooks = list(self.reducer.hooks.handles)
        hooks += self.gather.handles if self.gather is not None else []
        hooks += self.publisher.handles if self.publisher is not None else []
        return hooks

    # ---------------------------------------------------------------- the reducer's calls
    def _check_paths(self) -> None:
        if self.gather is not None:
            self.gather.check_uses()

    def _check_backward_path(self) -> None:
        if self.gather is not None:
            self.gather.end_of_backward_check()

    def _unit_grads_ready(self, unit: FlatUnit) -> None:
        if self.gather is not None:
            self.gather.grads_ready(unit)

    def _backward_ended(self) -> None:
        if self.gather is not None:
            self.gather.release_all()
            self.gather.end_of_pass()
        self._on_backward_end()

    # ---------------------------------------------------------------- making units whole
    def begin_step(self) -> None:
        """A framework's step begins instead of the root's forward: stage 3 gathers the
        root unit and holds it until the step ends."""
        if self.gather is not None:
            self.gather.begin_step()

    def publish(self, copies_written: bool = False, after_step: bool = False) -> None:
        """The masters changed (a step, a load): the compute copies follow (unless the
        fused step wrote them; `after_step`, only those of units the step can change: a
        frozen unit's master is not stepped), `on_masters_changed` is told (what a read
        gathered holds old values), and every rank's whole parameters follow. Stages 1-2
        start gathering every unit (the next forward waits per module); stage 3 frees what
        was held gathered and refreshes the units that stay gathered."""
        for unit in self.units:
            changed = unit.layout.trainable or not after_step
            if unit.layout.numel and changed and not copies_written:
                unit.sync_compute_from_master()
        self._on_masters_changed()
        if self.publisher is not None:
            self.publisher.launch()
        elif self.gather is not None:
            self.gather.release_all()  # units left gathered (unshard()) hold old values
            self.gather.regather_persistent()

    def finish_publishing(self) -> None:
        """Stages 1-2: the post-step gathers in flight are done (before the whole
        parameters are read or written outside their modules' forward)."""
        if self.publisher is not None:
            self.publisher.wait_all()

    def make_all_whole(self) -> None:
        """Every unit whole now, until its next use frees it (stage 3) or for good."""
        if self.gather is None:
            self.finish_publishing()
            return
        for unit in self.units:
            self.make_whole(unit)

    def make_whole(self, unit: FlatUnit) -> None:
        """Stage 3: `unit` whole now (a state dict), until its next use frees it."""
        if self.gather is not None:
            self.gather.ensure(unit, STATE_DICT)

    def gather_for_read(self, unit: FlatUnit) -> None:
        """Stage 3: `unit` whole now for a read of its values (in a forward: that
        forward's use of it), until its next use frees it."""
        if self.gather is not None:
            self.gather.gather_for_read(unit)

    def release_all(self) -> None:
        """Stage 3: free every gathered unit now (the spare buffers stay for reuse)."""
        if self.gather is not None:
            self.gather.release_all()

    # ---------------------------------------------------------------- the end
    def settle(self) -> None:
        """Finish the work in flight: reductions, post-step gathers, held units."""
        self.reducer.wait()
        self.finish_publishing()
        self.release_all()

    def drop(self) -> None:
        """Let go of the work in flight without waiting (a peer is gone, or the process
        is ending after an error)."""
        self.reducer.drop()
        if self.publisher is not None:
            self.publisher.drop()
        if self.gather is not None:
            self.gather.abandon()
