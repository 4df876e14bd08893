"""Close every live engine at interpreter exit.

A gloo job whose groups are torn down by the interpreter's own finalisation, with work
objects still holding tensors and a peer already gone, can abort at exit ("terminate
called without an active exception"): a scheduler reads that as a failed job. Engines
still alive when the script ends are closed here first, in the order they were made:
each finishes its work in flight, lets go of its work handles and destroys its groups.
Waiting on work a dead peer will never finish is bounded by the collective timeout, and
a failure there is not raised at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from typing import Protocol


class Closable(Protocol):
    def close(self) -> None: ...


_live: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(engine: Closable) -> None:
    _live.add(engine)


@atexit.register
def _close_live() -> None:
    for engine in list(_live):
        with contextlib.suppress(Exception):
            engine.close()
