"""A failed offload write, raised on every rank at once.

A write fails on one rank (its disk is full, its device errs) while the others' succeed.
Raised where it was found, mid-step, it would leave that rank out of the collectives the
others go on to: they would wait until the timeout and blame a lost peer. So the tiers
keep the failure (`failure`), and at the start of the next step (before any rank reads
the files again) every rank waits for the last step's writes, long done by then, and says
whether one failed: if any did, every rank's tiers refuse further use until a checkpoint
is loaded, and every rank raises, the failing ones their own error, the others naming
them. The step that wrote never waits for its writes.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

import torch

from ..comm.communicator import Communicator
from .offload_file import OffloadError


class KeptFailure:
    """What a disk store keeps of its failed writes: the first one (`failure`), until
    the engine asks, and whether it refuses to be used (`_failed`, set by `refuse`)."""

    failure: BaseException | None = None
    _failed: str | None = None

    def _note(self, writing: Future) -> None:
        """Keep the first failed write (a done write's exception, if any)."""
        failure = writing.exception()
        if failure is not None and self.failure is None:
            self.failure = failure

    def refuse(self) -> None:
        """A write failed (here or on another rank): the file is behind the training, and
        the store refuses to be used until a checkpoint is loaded."""
        failure = self.failure or OffloadError(errno.EIO, "another rank's offload write failed")
        self._failed = self._failed or f"{type(failure).__name__}: {failure}"


class Tier(Protocol):
    failure: BaseException | None

    def settle(self, wait: bool) -> None: ...

    def refuse(self) -> None: ...


def agree_on_write_failures(tiers: Sequence[Tier], everyone: Communicator) -> None:
    """Start of a step, on every rank: raise if a write failed on any rank (collective)."""
    for tier in tiers:
        tier.settle(wait=True)
    mine = next((t.failure for t in tiers if t.failure is not None), None)
    flags = everyone.control_all_gather(torch.tensor([float(mine is not None)]))
    failed = [rank for rank, flag in enumerate(flags.view(-1).tolist()) if flag]
    if not failed:
        return
    for tier in tiers:
        tier.refuse()
    if mine is not None:
        raise mine
    raise OffloadError(
        errno.EIO,
        f"an offload write failed on rank(s) {failed} (their logs say why), so their "
        "state is behind the training and this step cannot be taken. Load a checkpoint "
        "(engine.load_checkpoint) to continue, once the disk is fixed.",
    )
