"""Close every live engine at interpreter exit (and, for the strategies, the default
process group their framework left alive).

A gloo job whose groups are torn down by the interpreter's own finalisation, with work
objects still holding tensors and a peer already gone, can abort at exit ("terminate
called without an active exception"): a scheduler reads that as a failed job. Engines
still alive when the script ends are closed here first: each finishes its work in
flight, lets go of its work handles and destroys its groups. Waiting on work a dead peer
will never finish is bounded by the collective timeout, and a failure there is not raised
at exit. A script that ends on an uncaught error does not wait at all (its peers may be
gone, and the launcher should learn of the failure at once): the work is dropped.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import weakref
from typing import Protocol


class Closable(Protocol):
    def close(self, wait: bool = True) -> None: ...


_live: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(engine: Closable) -> None:
    _live.add(engine)


def live_engines() -> list:
    """The engines not yet garbage collected (for finding the one sharding a module)."""
    return list(_live)


_default_group_too = False


def destroy_default_group_at_exit() -> None:
    """Also destroy the default process group at exit, after the engines (a strategy
    whose framework set it up and never tears it down: Lightning's and Fabric's spawned
    and script-launched ranks end with it alive, and gloo can abort them then)."""
    global _default_group_too
    _default_group_too = True


@atexit.register
def _close_live() -> None:
    failed = hasattr(sys, "last_value")  # set when an uncaught error ended the script
    for engine in list(_live):
        with contextlib.suppress(Exception):
            engine.close(wait=not failed)
    if _default_group_too:
        import torch.distributed as dist  # loaded already: a group was set up

        with contextlib.suppress(Exception):
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
