"""Stage 3: every rank issues the same parameter gathers in the same order, whatever path
each rank's forward and backward take through the model.

Ranks that take different module paths would pair mismatched collectives: a hang, a gloo
abort on mismatched sizes, or, worse, gradients of one module summed into another's
(same-sized blocks). So every rank posts a stream of small tags, exchanged over its
data-parallel ranks on a gloo group of their own; the k-th tags of all ranks form round
k, read by every rank in order:

- GATHER (unit, phase): a parameter gather this rank will issue. A gather is issued once
  its round has come back: the same from every rank, it is that gather; differing, every
  gather any rank named in it is issued, in rank order, each once (`_merge`), this rank
  keeping the units it asked for and dropping the data of the others.
- USE (unit, phase): this rank's training forward or its backward entered the unit's
  module. A gradient reduction waits until the uses before it came back; once a round of
  this pass has differed (`diverged`), reductions go out only as REDUCE rounds release
  them (reductions share the group with the gathers, so they must interleave alike). An
  evaluation forward posts none.
- REDUCE (position), only in a pass whose paths differ: this rank has every gradient of
  the reduction order before `position` (or knows it will have none: a unit it did not
  run). Once every rank's REDUCE tags have reached a position, the reductions before it
  go out, on every rank while it reads that same round (`release`): so they interleave
  alike with the gathers, and a rank that skipped a module does not hold the rest of
  backward's gradients until its end.
- END, then IDLE: the end of a backward. A rank whose backward has ended posts IDLE tags,
  taking part in the others' gathers, until every rank has posted END; every rank leaves
  in the same round. With agreeing paths that is END's own round.

Only what cannot be reconciled raises `ModulePathDivergenceError`, naming each rank's
module: a state_dict() on some ranks only (every rank would take part in a gather of the
whole model for it), and, without `join_gather`, any difference.

Tags are posted asynchronously and checked only when the gather or reduction they guard
is due (or earlier, without waiting, once they have landed). A gather the recorded module
order predicts is posted a unit early (`announce`), so its tag has long landed when it is
due: a gather waits for no rank beyond what its data needs. A gather nobody predicted is
posted and checked at once (every rank meets there).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..comm.communicator import Communicator

FORWARD, BACKWARD, STATE_DICT = 0, 1, 2
_PHASE_NAMES = {FORWARD: "forward", BACKWARD: "backward", STATE_DICT: "state_dict"}
# IDLE: a rank whose backward has ended, while another's goes on. REDUCE: how far in the
# reduction order this rank could send (posted only in a pass whose paths differ).
GATHER, USE, END, IDLE, REDUCE = 0, 1, 2, 3, 4


class ModulePathDivergenceError(RuntimeError):
    """Ranks disagreed in a way that cannot be reconciled (stage 3): a state_dict() on
    some ranks only."""


@dataclass
class _Posted:
    seq: int
    kind: int
    index: int
    phase: int
    everyone: torch.Tensor  # every rank's tag, once the exchange lands
    work: object


class OrderCheck:
    """The tags this rank posted and no one has checked yet, oldest first."""

    def __init__(
        self,
        comm: Communicator,
        unit_name: Callable[[int], str | None],
        launch_gather: Callable[[int], None],
        before_raising: Callable[[], None] = lambda: None,
        join_gather: Callable[[int, bool], None] | None = None,
        release: Callable[[int], None] = lambda position: None,
    ):
        self.comm = comm
        self.unit_name = unit_name  # a unit's module name, None for an unknown index
        self.launch_gather = launch_gather  # issues a checked gather of a unit index
        # Ranks whose paths differ: every rank takes part in the gathers any rank posted,
        # keeping the unit (True: this rank asked for it) or not (`merge_rounds`). None:
        # a differing tag raises.
        self.join_gather = join_gather
        # This pass (forward and backward) saw ranks whose paths differ: the gradient
        # reductions go out only as REDUCE rounds release them (`reach`).
        self.diverged = False
        self._ended: set[int] = set()  # ranks whose backward has ended, this pass
        # The reductions before a position every rank has reached go out (`reach`).
        self.release = release
        self._reached: dict[int, int] = {}  # rank -> its latest REDUCE position
        self._released = 0
        # Before this rank raises a divergence: the collectives every rank agreed on and
        # this one issued are finished, so that a peer waiting for their data gets it and
        # reaches the differing tag itself (rather than finding this rank gone).
        self.before_raising = before_raising
        self._posted: deque[_Posted] = deque()
        self._announced: set[int] = set()  # unit indices with a GATHER tag posted
        self._seq = 0  # tags posted by this process
        self._last_use = 0  # seq of the latest USE or END tag
        # Gathers checked the moment they were posted (no prediction announced them):
        # each holds this rank until every rank reaches it.
        self.unannounced = 0

    # ------------------------------------------------------------------ posting
    def _post(self, kind: int, index: int, phase: int) -> int:
        self._seq += 1
        tag = torch.tensor([kind, index, phase], dtype=torch.int64)
        self._check_landed()
        everyone, work = self.comm.control_all_gather_async(tag)
        self._posted.append(_Posted(self._seq, kind, index, phase, everyone, work))
        return self._seq

    def _check_landed(self) -> None:
        """Check the oldest tags that have landed, up to the first gather's (checking
        that one would issue its gather early): a long run of uses with no gather (every
        unit kept gathered) does not pile up."""
        while self._posted and self._posted[0].kind != GATHER:
            if not self._posted[0].work.is_completed():
                break
            self._check_oldest()

    def announce(self, index: int, phase: int) -> None:
        """This rank will gather unit `index` (once every earlier announced gather is
        issued); the caller saw it neither gathered nor in flight."""
        if index not in self._announced:
            self._announced.add(index)
            self._post(GATHER, index, phase)

    def use(self, index: int, phase: int) -> None:
        self._last_use = self._post(USE, index, phase)

    def reach(self, position: int) -> None:
        """This rank has (or will never have) every gradient before `position` of this
        backward's reduction order (a pass whose paths differ)."""
        self._post(REDUCE, position, BACKWARD)

    def end_of_backward(self) -> None:
        """Close the pass: every rank's tags so far agree (or, merging, every rank's
        backward has ended: this rank posts IDLE tags, taking part in the others' gathers,
        until the last one ends). Every rank returns at the same round."""
        self._last_use = self._post(END, -1, BACKWARD)
        self.check_through(self._last_use)
        while len(self._ended) < self.comm.size:
            self._last_use = self._post(IDLE, -1, BACKWARD)
            self.check_through(self._last_use)
        self._new_pass()

    def _new_pass(self) -> None:
        self._ended.clear()
        self._reached.clear()
        self._released = 0
        self.diverged = False

    # ------------------------------------------------------------------ checking
    def gather_now(self, index: int, phase: int) -> None:
        """Issue the gather of unit `index`: announced earlier, or announced now and
        checked at once. Every gather announced before it is issued first."""
        if index not in self._announced:
            self.unannounced += 1
            self.announce(index, phase)
        while index in self._announced:
            self._check_oldest()

    def check_uses(self) -> None:
        """Before a gradient reduction: the module paths so far agree."""
        self.check_through(self._last_use)

    def check_through(self, seq: int) -> None:
        while self._posted and self._posted[0].seq <= seq:
            self._check_oldest()

    def _check_oldest(self) -> None:
        posted = self._posted.popleft()
        try:
            posted.work.wait()
            tags = posted.everyone.tolist()
            self._ended.update(rank for rank, (kind, _, _) in enumerate(tags) if kind == END)
            if all(t == tags[0] for t in tags):
                if posted.kind == GATHER:
                    self._announced.discard(posted.index)
                    self.launch_gather(posted.index)
            elif self.join_gather is None or any(phase == STATE_DICT for _, _, phase in tags):
                self.before_raising()
                raise self._divergence(posted.seq, tags)
            else:
                self._merge(posted, tags)
            if self.diverged:
                self._release_reached(tags)
        except BaseException:
            self.forget()  # the engine cannot go on (a peer is gone, or paths differ)
            raise

    def _merge(self, posted: _Posted, tags: list[list[int]]) -> None:
        """A round whose tags differ: every rank issues the gathers it names, in rank
        order, each once. This rank keeps a unit it asked for (its own tag, or one
        announced for later); it takes part in the others' gathers and drops the data."""
        self.diverged = True
        named: list[int] = []
        for kind, index, _ in tags:
            if kind == GATHER and index not in named:
                named.append(index)
        for index in named:
            mine = (posted.kind == GATHER and posted.index == index) or index in self._announced
            self._announced.discard(index)
            self.join_gather(index, mine)

    def _release_reached(self, tags: list[list[int]]) -> None:
        """After a round of a pass whose paths differ: the reductions before the position
        every rank has reached go out (a rank whose backward ended has reached them all)."""
        for rank, (kind, index, _) in enumerate(tags):
            if kind == REDUCE:
                self._reached[rank] = max(self._reached.get(rank, 0), index)
        everyone = min(
            float("inf") if rank in self._ended else self._reached.get(rank, 0)
            for rank in range(len(tags))
        )
        if everyone > self._released:
            self._released = everyone
            self.release(everyone)

    def forget(self) -> None:
        """Drop the tags in flight without waiting (a peer is gone, or the process ends
        after an error)."""
        self._posted.clear()
        self._announced.clear()
        self._new_pass()

    # ------------------------------------------------------------------ the error
    def _divergence(self, seq: int, tags: list[list[int]]) -> ModulePathDivergenceError:
        lines = [f"  rank {rank}: {self._describe(*tag)}" for rank, tag in enumerate(tags)]
        hint = (
            "\nstate_dict() and load_state_dict() gather a stage-3 model, so every rank must "
            "call them (not only rank 0); to write the model from rank 0 alone, use "
            "engine.full_state_dict() on every rank, or save a checkpoint and consolidate it. "
            "Reading a parameter's values outside forward (model.layer.weight.sum(), "
            ".data, .item(), an op over model.parameters()) gathers its unit too (its "
            "shape, dtype and device do not): read them on every rank, or inside "
            "engine.gathered_parameters() on every rank, then use the values on one."
            if any(phase == STATE_DICT for _, _, phase in tags)
            else ""
        )
        return ModulePathDivergenceError(
            "ZeRO stage 3: ranks took different module paths and would deadlock on the "
            f"parameter gathers or gradient reductions (order check #{seq} of this "
            "process):\n"
            + "\n".join(lines)
            + "\nEvery rank must call the same wrapped modules in the same order. Make the "
            "control flow identical on all ranks (e.g. run every branch, or decide the branch "
            "on rank 0 and broadcast it), or put the divergent modules inside one unit "
            "(ZeroConfig.unit_module_classes) so they are gathered together." + hint
        )

    def _describe(self, kind: int, index: int, phase: int) -> str:
        if kind in (END, IDLE):
            return "the end of backward"
        if kind == REDUCE:
            return "its gradient reductions"
        where = f"{_PHASE_NAMES.get(phase, '?')} of {self._module(index)}"
        return f"{where} (its parameter gather)" if kind == GATHER else where

    def _module(self, index: int) -> str:
        name = self.unit_name(index)
        return f"module '{name}'" if name is not None else f"unknown unit {index}"
