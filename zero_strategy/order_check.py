"""Stage 3's divergence check: every rank gathers the same unit at the same point.

Ranks that take different module paths would pair mismatched gathers and hang (or, on
gloo, abort on mismatched sizes). So before each gather, every rank's (unit, phase) tag
is exchanged over all ranks, and any disagreement raises on every rank, naming each
rank's module.

Exchanging the tag right before the gather puts every rank in lockstep at every unit: a
rank a little behind (gloo's threads share the cores with compute) holds the others up,
once per unit. So the tag of a gather the recorded module order predicts is *announced*
one unit early, its exchange left in flight; when the gather is due, the exchange has
long landed. What keeps this safe is one rule: a rank issues its gathers in exactly the
order of its announcements (a gather nobody announced is announced then, and waited for
at once). The k-th exchange on every rank then describes the k-th gather, and a gather
is issued only after its exchange showed every rank the same tag. A rank whose path left
the prediction still issues what it announced (a harmless extra gather), then announces
its real one; whichever rank differs, the same exchange shows it to all of them.

The tags travel on a group of their own, so they only ever pair with each other.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from .comm import Communicator

FORWARD, BACKWARD, STATE_DICT = 0, 1, 2
_PHASE_NAMES = {FORWARD: "forward", BACKWARD: "backward", STATE_DICT: "state_dict"}


class ModulePathDivergenceError(RuntimeError):
    """Ranks disagreed on which module to gather next (stage 3)."""


class OrderCheck:
    """Announced gathers, in the order they will be issued, each with its tag exchange."""

    def __init__(self, comm: Communicator, unit_name: Callable[[int], str | None]):
        self.comm = comm
        self.unit_name = unit_name  # a unit's module name, None for an unknown index
        self._announced: deque[tuple[int, int, torch.Tensor, object]] = deque()
        self._exchanges = 0  # of this process, for the error message
        # Checks made only when their gather was due (nothing announced them): each holds
        # this rank until every rank reaches it.
        self.unannounced = 0

    def announce(self, index: int, phase: int, instead_of: int = -1) -> None:
        """This rank's next gather not yet announced will be of unit `index` (`instead_of`:
        an announced unit this rank turned out not to need, for the error message)."""
        tag = torch.tensor([index, phase, instead_of], dtype=torch.int64)
        everyone, work = self.comm.control_all_gather_async(tag)
        self._announced.append((index, phase, everyone, work))

    def is_announced(self, index: int) -> bool:
        return any(entry[0] == index for entry in self._announced)

    def next_announced(self) -> tuple[int, int] | None:
        """(unit index, phase) of the gather this rank must issue next, if announced."""
        return self._announced[0][:2] if self._announced else None

    def confirm(self, index: int, phase: int, instead_of: int = -1) -> int:
        """Just before gathering unit `index`: wait for its exchange (announcing it now if
        nobody did) and raise if any rank's tag differs. Returns the announced phase."""
        if not self._announced:
            self.unannounced += 1
            self.announce(index, phase, instead_of)
        announced, phase, everyone, work = self._announced.popleft()
        if announced != index:
            raise RuntimeError(
                f"internal error: gather of unit {index} issued before the announced unit "
                f"{announced}"
            )
        work.wait()
        self._exchanges += 1
        tags = everyone.tolist()
        if any(t[:2] != tags[0][:2] for t in tags):
            raise self._divergence(tags)
        return phase

    def forget(self) -> None:
        """Drop the announcements without waiting (a peer is gone, or the process ends
        after an error)."""
        self._announced.clear()

    def _divergence(self, tags: list[list[int]]) -> ModulePathDivergenceError:
        lines = []
        for rank, (index, phase, instead_of) in enumerate(tags):
            line = f"  rank {rank}: {_PHASE_NAMES.get(phase, '?')} of {self._module(index)}"
            if instead_of >= 0:
                line += (
                    f", where the order recorded on the first training step has "
                    f"{self._module(instead_of)}"
                )
            lines.append(line)
        hint = (
            "\nstate_dict() and load_state_dict() gather a stage-3 model, so every rank must "
            "call them (not only rank 0); to write the model from rank 0 alone, use "
            "engine.full_state_dict() on every rank, or save a checkpoint and consolidate it."
            if any(phase == STATE_DICT for _, phase, _ in tags)
            else ""
        )
        return ModulePathDivergenceError(
            "ZeRO stage 3: ranks took different module paths and would deadlock on the "
            f"parameter gather (order check #{self._exchanges} of this process):\n"
            + "\n".join(lines)
            + "\nEvery rank must call the same wrapped modules in the same order. Make the "
            "control flow identical on all ranks (e.g. run every branch, or decide the branch "
            "on rank 0 and broadcast it), or put the divergent modules inside one unit "
            "(ZeroConfig.unit_module_classes) so they are gathered together." + hint
        )

    def _module(self, index: int) -> str:
        name = self.unit_name(index)
        return f"module '{name}'" if name is not None else f"unknown unit {index}"
