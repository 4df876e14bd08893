"""Stage 3: gather a unit's parameters just before they are used, free them right after.

Forward: a pre-hook on the unit's module gathers it (or waits for its prefetch), a post-hook
frees it and hooks the module's outputs so that the unit is gathered again when backward
reaches them. The root unit (parameters outside every wrapped module) is gathered on first
use and kept until the end of backward, since backward starts with it.

The order in which units are gathered on the first training step is recorded; afterwards
each gather prefetches the next `prefetch_depth` units of that order (forward) or of its
reverse (backward).

Ranks that take different module paths would pair up mismatched collectives and hang.
With `verify_module_order`, every gather waits for an exchange of tags over the
data-parallel ranks (`order_check`), and where the ranks' paths differ every rank takes
part in every gather any rank asked for; the gathers the recorded order predicts are
announced a unit early, so that their exchanges have landed by the time they are due.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from ..comm.communicator import Communicator
from ..private_api import in_backward, tree_flatten
from .flat_unit import FlatUnit
from .module_hooks import EngineHook
from .order_check import (  # noqa: F401 (re-exported)
    BACKWARD,
    FORWARD,
    STATE_DICT,
    ModulePathDivergenceError,
    OrderCheck,
)
from .storage_pool import StoragePool

# Offloaded shards (offload_params="disk") asked for beyond the gather prefetch; the tier
# reads as many of them ahead as its buffers allow.
READ_AHEAD = 3


class WrittenValues(Protocol):
    """What code outside the engine wrote to a unit's parameters (`param.data = values`),
    taken before a gather points them anew and adopted once it is whole, or adopted just
    before a free (`model_view/replaced_data.py`)."""

    def taken(self, unit: FlatUnit) -> dict[int, torch.Tensor]: ...
    def adopt_unit(
        self, unit: FlatUnit, written: dict[int, torch.Tensor] | None = None
    ) -> None: ...


class _NothingWritten:
    def taken(self, unit: FlatUnit) -> dict[int, torch.Tensor]:
        return {}

    def adopt_unit(self, unit: FlatUnit, written: dict[int, torch.Tensor] | None = None) -> None:
        pass


class GatherManager:
    def __init__(
        self,
        model: nn.Module,
        units: list[FlatUnit],
        order_tags: Communicator | None,
        prefetch_depth: int,
        persistence_threshold: int,
        max_reuse_distance: int,
        on_backward_start: Callable[[], None],
        on_memory: Callable[[], None] = lambda: None,
        finish_reductions: Callable[[], None] = lambda: None,
        release_reductions: Callable[[int], None] = lambda position: None,
        written: WrittenValues | None = None,
    ):
        self.units = units
        self.written = _NothingWritten() if written is None else written
        self.on_memory = on_memory  # told after a gather's memory is taken or given back
        # The divergence check over the data-parallel ranks (None: off).
        self.order_check = (
            None
            if order_tags is None
            else OrderCheck(
                order_tags,
                lambda i: units[i].layout.name if 0 <= i < len(units) else None,
                lambda i: self._launch_gather(units[i]),
                lambda: self._finish_agreed(finish_reductions),
                join_gather=self._join_gather,
                release=release_reductions,
            )
        )
        # Units whose module a training forward entered since the last backward ended.
        self._entered: set[int] = set()
        # Gathers this rank takes part in for other ranks only (their paths differ):
        # (unit, work, buffer), dropped as they complete.
        self._for_others: list[tuple[FlatUnit, object, torch.Tensor]] = []
        # The units every data-parallel rank holds alike, whose gathers and reductions
        # span those ranks: the ones the order check follows. Experts are held apart, each
        # by its expert-data-parallel group, and a rank whose experts get no token may
        # skip them (Transformers' eager experts do); the routing decides, not a bug.
        self._checked = [unit.group.spec.replicated for unit in units]
        self.prefetch_depth = prefetch_depth
        self.max_reuse_distance = max_reuse_distance
        self._reuse_distance: dict[int, int] = {}  # unit index -> numel gathered in between
        self.on_backward_start = on_backward_start
        self.pending: dict[int, object] = {}  # unit index -> in-flight gather work
        self._live: set[int] = set()  # units gathered since they were last seen empty
        self.order: list[int] | None = None  # recorded forward order (non-root units)
        self._recording: list[int] = []
        self._cursor = 0
        # A framework's step holds the root unit (begin_step) until it ends (release_all).
        self._step_holds_root = False
        # Root forwards running on this rank (nested ones counted), and whether a training
        # one (grad enabled) began since the last backward ended: a read of a freed unit's
        # values inside one is that forward's use of the unit (`gather_for_read`).
        self._forward_depth = 0
        self._training_forward = False
        self._backward_left: set[int] = set()  # this backward: units it has passed through
        self._grads_in: set[int] = set()  # this backward: units whose gradients are in
        self.handles: list = []
        # One spare per size: what a unit freed is what the next gather of that size
        # fills (more spares only sit idle at the peak of backward).
        self.storage_pool = StoragePool(capacity=1)
        for unit in units:
            small = unit.layout.numel < persistence_threshold or unit.layout.numel == 0
            unit.set_residency(persistent=small, pool=self.storage_pool)
        self._install_hooks(model)

    # ---------------------------------------------------------------- hooks
    def _install_hooks(self, model: nn.Module) -> None:
        root = self.units[0]
        for unit in self.units[1:]:
            module = model.get_submodule(unit.layout.module_path)
            self.handles.append(
                module.register_forward_pre_hook(
                    EngineHook(self._make_pre_forward(unit)), with_kwargs=True
                )
            )
            self.handles.append(
                module.register_forward_hook(EngineHook(self._make_post_forward(unit)))
            )
        # The root unit is needed from the first module that owns one of its parameters
        # (or from the root forward itself) until the end of backward.
        owners = {""}
        for slot in root.layout.slots:
            for name in (slot.name, *slot.aliases):
                owners.add(name.rsplit(".", 1)[0] if "." in name else "")

        def gather_root(*_) -> None:  # a pre-hook's return value would replace the inputs
            self.gather_root()

        for path in sorted(owners):
            module = model.get_submodule(path)
            self.handles.append(module.register_forward_pre_hook(EngineHook(gather_root)))
        self.handles.append(model.register_forward_pre_hook(EngineHook(self._root_pre_forward)))
        self.handles.append(model.register_forward_hook(EngineHook(self._root_post_forward)))
        self.handles.append(  # also when the forward raises
            model.register_forward_hook(EngineHook(self._root_left), always_call=True)
        )

    def begin_step(self) -> None:
        """A framework's step begins instead of the root's forward (Lightning's
        training_step): the forward order starts over, and the root unit is gathered and
        held until the step's end frees it (`release_all`: the end of backward, or the
        evaluation step's reshard), even across root forwards inside the step."""
        if not in_backward():
            self._cursor = 0
            self._forward_begins()
        self._step_holds_root = True
        self.gather_root()

    def gather_root(self) -> None:
        """Make the root unit usable (kept until the end of backward, or the evaluation's
        release): from its first module's forward, or from the start of a step that a
        framework runs instead of the root's forward. The first call of a forward also
        posts the checks of the next gathers and starts their prefetch."""
        root = self.units[0]
        starting = not in_backward() and self.order is not None and self._cursor == 0
        if starting:  # the forward's first gathers: their checks go out together
            for unit in (root, *(self.units[i] for i in self.order[: self.prefetch_depth + 1])):
                self._announce(unit, FORWARD)
        self.ensure(root, FORWARD)
        if starting:
            self._prefetch_forward(root)

    def _make_pre_forward(self, unit: FlatUnit):
        has_frozen = any(not slot.trainable for slot in unit.layout.slots)

        def hook(module, args, kwargs):
            training = not in_backward() and torch.is_grad_enabled()
            phase = BACKWARD if in_backward() else FORWARD
            if training or in_backward():  # what gradient reductions will follow
                self._post_use(unit, phase)
            if training:
                self._entered.add(unit.layout.index)
            if not in_backward():
                self._track_order(unit, record=training)
            self.ensure(unit, phase)
            if not in_backward():
                self._prefetch_forward(unit)
            if training and has_frozen:
                self._free_when_backward_leaves(unit, (args, kwargs))

        return hook

    def _free_when_backward_leaves(self, unit: FlatUnit, inputs) -> None:
        """A unit with frozen parameters cannot be freed when its trainable gradients are
        in: backward may still need the frozen ones (a frozen first layer, LoRA's base
        weights) to reach the unit's inputs. Free it once the gradients of those inputs
        are computed; with no input that needs a gradient, at the end of backward."""
        tensors = [
            t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if tensors:
            register_multi_grad_hook(tensors, lambda _grads: self._left(unit), mode="all")

    def _left(self, unit: FlatUnit) -> None:
        self._backward_left.add(unit.layout.index)
        if not unit.layout.trainable or unit.layout.index in self._grads_in:
            self._free_if_idle(unit)

    def grads_ready(self, unit: FlatUnit) -> None:
        """The unit's trainable gradients are in. A fully trainable unit is done with; one
        with frozen parameters also waits for backward to leave its module (a frozen
        weight may still be needed on a branch that leads to no input)."""
        self._grads_in.add(unit.layout.index)
        if unit.layout.all_trainable or unit.layout.index in self._backward_left:
            self._free_if_idle(unit)

    def _free_if_idle(self, unit: FlatUnit) -> None:
        if not unit.persistent and unit.layout.index not in self.pending:
            self._free(unit)

    def _free(self, unit: FlatUnit) -> None:
        if unit.gathered:
            self.written.adopt_unit(unit)  # written while whole: kept, as under DDP
            unit.free_full()
            self.on_memory()

    def _make_post_forward(self, unit: FlatUnit):
        def hook(module, args, output):
            if in_backward():  # activation recomputation: backward still needs it
                return output
            tensors = [
                t
                for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors and torch.is_grad_enabled():
                register_multi_grad_hook(
                    tensors, lambda _grads: self._pre_backward(unit), mode="any"
                )
            if not unit.persistent and not (tensors and self._kept_for_backward(unit)):
                self._free(unit)
            return output

        return hook

    def _kept_for_backward(self, unit: FlatUnit) -> bool:
        """Whether backward reuses `unit` soon enough (in gathered elements) to skip the
        free and re-gather; it is then freed once its gradients are reduced."""
        distance = self._reuse_distance.get(unit.layout.index)
        return (
            torch.is_grad_enabled() and distance is not None and distance < self.max_reuse_distance
        )

    def _root_pre_forward(self, *_) -> None:
        if not in_backward():
            self._forward_depth += 1
            self._forward_begins()

    def _root_left(self, *_) -> None:
        if not in_backward():
            self._forward_depth = max(0, self._forward_depth - 1)

    def _forward_begins(self) -> None:
        """A root forward or a framework's step begins. In training, the units already
        whole (a read between steps left them so: an EMA kept by hand) count as entered:
        a read of them needs no gather, so nothing else would tell that their gradients
        may come (at worst this rank waits for one until its backward ends)."""
        if torch.is_grad_enabled():
            self._training_forward = True
            self._entered.update(
                u.layout.index for u in self.units[1:] if u.gathered and not u.persistent
            )

    def gather_for_read(self, unit: FlatUnit) -> None:
        """Make `unit` whole for a read of its values (`model_view/parameter_reads.py`).
        Inside a forward (or a framework's step) the read is that forward's use of the
        unit, as its module's call would be: a module that reads another's weight instead
        of calling it (MultiheadAttention reads its `out_proj`'s; under PEFT that is a unit
        of its own) on a path other ranks skip (a vision tower on a text-only batch) is
        merged as a skipped module's gather is. Outside one every rank must read alike."""
        if not (self._forward_depth or self._step_holds_root):
            self.ensure(unit, STATE_DICT)
            return
        if self._training_forward:  # its gradients may come, as an entered module's
            self._post_use(unit, FORWARD)
            self._entered.add(unit.layout.index)
        self.ensure(unit, FORWARD)

    def _root_post_forward(self, module, args, output):
        if in_backward():
            return output
        if not torch.is_grad_enabled():
            if not self._step_holds_root:  # evaluation: nothing needs the parameters again
                self.release_all()
            self._cursor = 0
        elif self.order is not None:  # backward's first gathers: their checks go out now
            for idx in reversed(self.order[-(self.prefetch_depth + 2) :]):
                self._announce(self.units[idx], BACKWARD)
            self._cursor = 0  # a next forward (before this backward, or none) starts over
        return output

    def _pre_backward(self, unit: FlatUnit) -> None:
        self.on_backward_start()
        self._post_use(unit, BACKWARD)
        self.ensure(unit, BACKWARD)
        self._prefetch_backward(unit)

    def _post_use(self, unit: FlatUnit, phase: int) -> None:
        if self.order_check is not None and self._checked[unit.layout.index]:
            self.order_check.use(unit.layout.index, phase)

    def check_uses(self) -> None:
        """Before a gradient reduction: every rank passed through the same modules so far
        (or this raises)."""
        if self.order_check is not None:
            self.order_check.check_uses()

    def end_of_backward_check(self) -> None:
        """Before backward's last reductions: every rank's backward has ended (ranks whose
        paths differed took part in each other's gathers meanwhile). Gathers announced but
        not needed are issued (every rank does) and freed with the rest at the end of
        backward."""
        if self.order_check is not None:
            self.order_check.end_of_backward()
            self._drop_gathers_for_others(wait=True)

    def not_run(self) -> set[int]:
        """The units (but the root) no training forward of this pass entered: no parameter
        of theirs can get a gradient (a unit is gathered for a forward only by its
        module's call, or by a read of its values inside the forward, which enters it)."""
        return {
            u.layout.index
            for u in self.units[1:]
            if not u.persistent  # (always whole)
        } - self._entered

    def reach(self, position: int) -> None:
        """A pass whose paths differ: this rank has every gradient before `position` of the
        reduction order (`order_check.reach`)."""
        if self.order_check is not None:
            self.order_check.reach(position)

    @property
    def paths_diverged(self) -> bool:
        """This pass saw ranks whose paths differ (the reductions wait for REDUCE rounds
        to release them)."""
        return self.order_check is not None and self.order_check.diverged

    def _join_gather(self, index: int, keep: bool) -> None:
        """A gather some rank asked for while the ranks' paths differ: this rank keeps the
        unit if it asked too (`keep`) and does not hold it yet; else it takes part with
        its shard and drops what arrives."""
        unit = self.units[index]
        if unit.layout.numel == 0:
            return
        self._drop_gathers_for_others(wait=False)
        if keep and self._needs_gather(unit):
            self._launch_gather(unit, fresh=True)
        else:
            self._for_others.append((unit, *unit.start_gather_for_others()))
            self.on_memory()

    def _drop_gathers_for_others(self, wait: bool) -> None:
        """Let go of the gathers done for other ranks that have completed (`wait`: all of
        them; every rank has issued them once every backward has ended)."""
        kept = []
        for unit, work, buffer in self._for_others:
            if wait or work.is_completed():
                work.wait()
                unit.let_go()
            else:
                kept.append((unit, work, buffer))
        if len(kept) != len(self._for_others):
            self._for_others = kept
            self.on_memory()

    # ---------------------------------------------------------------- order, prefetch
    def _track_order(self, unit: FlatUnit, record: bool) -> None:
        """Follow the forward through the recorded order (the first training forward
        records it), so that prefetches know what comes next."""
        if self.order is None:
            if record:
                self._recording.append(unit.layout.index)
            return
        if self._cursor < len(self.order) and self.order[self._cursor] == unit.layout.index:
            self._cursor += 1
        else:  # out of recorded order: resynchronise on this unit if it is in the trace
            idx = unit.layout.index
            self._cursor = self.order.index(idx) + 1 if idx in self.order else len(self.order)

    def end_of_pass(self) -> None:
        """Called at the end of each backward: freeze the trace after the first one."""
        if self.order is None and self._recording:
            self.order = self._recording
            self._reuse_distance = self._reuse_distances(self.order)
        self._recording = []
        self._cursor = 0
        self._training_forward = False
        self._entered.clear()
        self._backward_left.clear()
        self._grads_in.clear()

    def _reuse_distances(self, order: list[int]) -> dict[int, int]:
        """Elements gathered between a unit's (last) forward use and its backward use: the
        units after it, once in forward and once in backward."""
        distances: dict[int, int] = {}
        after = 0
        for idx in reversed(order):
            distances.setdefault(idx, 2 * after)
            after += self.units[idx].layout.numel
        return distances

    def _prefetch_forward(self, unit: FlatUnit) -> None:
        if self.order is None:
            return
        depth = self.prefetch_depth
        window = self.order[self._cursor : self._cursor + depth + READ_AHEAD]
        for idx in window[:depth]:
            self.start_gather(self.units[idx], FORWARD)
        if len(window) > depth:  # the gather after those: its check goes out now
            self._announce(self.units[window[depth]], FORWARD)
        for idx in window[depth:] if depth else ():  # offloaded shards: read them ahead
            self.units[idx].prefetch()

    def _prefetch_backward(self, unit: FlatUnit) -> None:
        if self.order is None or unit.layout.index not in self.order:
            return
        depth = self.prefetch_depth
        pos = self.order.index(unit.layout.index)
        for idx in reversed(self.order[max(0, pos - depth) : pos]):
            self.start_gather(self.units[idx], BACKWARD)
        if pos - depth > 0:  # the gather after those: its check goes out now
            self._announce(self.units[self.order[pos - depth - 1]], BACKWARD)
        stop = max(0, pos - depth)
        for idx in reversed(self.order[max(0, stop - READ_AHEAD) : stop]) if depth else ():
            self.units[idx].prefetch()  # offloaded shards: read them ahead

    # ---------------------------------------------------------------- gather / free
    def _needs_gather(self, unit: FlatUnit) -> bool:
        return not (unit.gathered or unit.layout.index in self.pending or unit.layout.numel == 0)

    def _announce(self, unit: FlatUnit, phase: int) -> None:
        """Post the order check of a gather the recorded order predicts."""
        idx = unit.layout.index
        if self.order_check is not None and self._checked[idx] and self._needs_gather(unit):
            self.order_check.announce(idx, phase)

    def start_gather(self, unit: FlatUnit, phase: int) -> None:
        """Launch an asynchronous gather of `unit` unless it is gathered or in flight.
        With the order check, once its tag (and those announced before it) came back the
        same from every rank: the gathers announced earlier go out first, in order."""
        if not self._needs_gather(unit):
            return
        if self.order_check is not None and self._checked[unit.layout.index]:
            self.order_check.gather_now(unit.layout.index, phase)
        else:
            self._launch_gather(unit)

    def _launch_gather(self, unit: FlatUnit, fresh: bool = False) -> None:
        idx = unit.layout.index
        if not self._needs_gather(unit):  # every rank issues it: the tags said so
            raise RuntimeError(
                f"internal error: unit {unit.layout.name!r} was announced for a gather "
                "but is gathered already"
            )
        self._live.add(idx)
        self.pending[idx] = unit.start_gather(fresh)
        self.on_memory()

    def gathered_bytes(self) -> int:
        """Bytes of the units gathered (or being gathered) now, as `memory_report`
        counts them, from the few units gathered since last seen empty."""
        total = 0
        for idx in list(self._live):
            held = self.units[idx].gathered_bytes()
            if held:
                total += held
            else:
                self._live.discard(idx)
        for _, _, buffer in self._for_others:
            total += buffer.numel() * buffer.element_size()
        return total

    def ensure(self, unit: FlatUnit, phase: int) -> bool:
        """Make `unit` usable now: gather it if needed, wait for its gather if in flight.
        Returns whether this call started the gather (the caller then owns the free)."""
        if unit.gathered or unit.layout.numel == 0:
            return False
        started = unit.layout.index not in self.pending
        self.start_gather(unit, phase)
        self._finish(unit)
        return started

    def _finish(self, unit: FlatUnit) -> None:
        written = self.written.taken(unit)  # before the gather points the parameters anew
        unit.finish_gather(self.pending.pop(unit.layout.index))
        if written:
            self.written.adopt_unit(unit, written)

    def _finish_agreed(self, finish_reductions: Callable[[], None]) -> None:
        """A divergence was found: wait for the gathers (and, through the engine, the
        reductions) this rank issued, each agreed on by every rank, so that none is left
        half done when this rank raises. A peer lost meanwhile is the error raised then."""
        for work in [*self.pending.values(), *(w for _, w, _ in self._for_others)]:
            with contextlib.suppress(Exception):
                work.wait()
        with contextlib.suppress(Exception):
            finish_reductions()

    def release_all(self) -> None:
        """Free every non-persistent gathered unit (and finish stray prefetches first)."""
        for idx in list(self.pending):
            self._finish(self.units[idx])
        self._free_all()

    def abandon(self) -> None:
        """Let go of the prefetches and order checks in flight without waiting, and free
        every non-persistent gathered unit (a peer is gone, or the process is ending after
        an error)."""
        self.pending.clear()
        self._for_others.clear()
        if self.order_check is not None:
            self.order_check.forget()
        self._free_all()

    def _free_all(self) -> None:
        self._step_holds_root = False
        for unit in self.units:
            unit.drop_secondary()  # the pass is over (or the shards change next)
            if not unit.persistent:
                self._free(unit)

    def regather_persistent(self) -> None:
        """After an optimizer step, refresh units that are never freed."""
        for unit in self.units:
            if unit.persistent and unit.gathered:
                unit.regather()
