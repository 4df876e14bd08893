"""The one order in which every rank sends its gradient reductions.

Reductions pair up across ranks only if every rank issues them in the same order.
Backward produces gradients in an order that follows the rank's own path through the
model: the same on every rank when the paths agree, different when a rank skips a module
(a vision tower on a text-only batch, LayerDrop, an early exit). So a gradient is not sent
when it is ready, but when its turn comes in one order that every rank holds alike:

- until the end of the first synchronised backward: the layout's order reversed (the last
  unit's last parameter first), about the order backward produces them in;
- after it: the order that backward produced them in, merged over the ranks by one
  exchange, once (`merge_orders`).

A gradient ready before its turn waits until every entry before it has gone out; at the
end of a synchronised backward every entry not yet sent goes out in order, as negative
zeros where this rank produced no gradient (`no_gradient`). When every rank takes the path of the agreed order, each
turn comes as its gradient is produced: nothing waits and nothing extra is sent. DDP does
the same with its buckets (launched in bucket order, rebuilt once from the first
iteration's order as rank 0 saw it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Entry = tuple[int, int]  # (unit index, slot index) of a trainable parameter
MISSING = object()  # an entry this rank produced no gradient for


def merge_orders(orders: Sequence[Sequence[Entry]], everything: Sequence[Entry]) -> list[Entry]:
    """One order from every rank's: rank 0's, then each entry another rank saw and the
    ones before did not, placed right before the entry that followed it on that rank (so
    a module only some ranks ran keeps its place), then what no rank saw, in the order of
    `everything`. The same on every rank, given the same inputs."""
    merged: list[Entry] = []
    for order in orders:
        known = set(merged)
        unseen: list[Entry] = []  # this rank's entries since its last known one
        for entry in order:
            if entry in known:
                at = merged.index(entry)
                merged[at:at] = unseen
                unseen = []
            elif entry not in unseen:
                unseen.append(entry)
        merged += unseen
    known = set(merged)
    return merged + [entry for entry in everything if entry not in known]


class ReductionOrder:
    """The agreed order of every trainable parameter's reduction, and its recording."""

    def __init__(
        self,
        trainable: Sequence[Sequence[bool]],
        exchange: Callable[[list], list] | None,
    ):
        """`trainable[u][s]`: whether slot `s` of unit `u` is reduced. `exchange` gives
        every rank's copy of a JSON-able value (None: a single process, whose order
        pairs with no one's and is never recorded)."""
        self.initial = [
            (u, s)
            for u in reversed(range(len(trainable)))
            for s in reversed(range(len(trainable[u])))
            if trainable[u][s]
        ]
        self.exchange = exchange
        self.entries: list[Entry] = list(self.initial)
        self._seen: dict[Entry, None] | None = {} if exchange is not None else None

    @property
    def agreed(self) -> bool:
        return self._seen is None

    def saw(self, entry: Entry) -> None:
        """A gradient backward produced, in the order it came (until the order is agreed)."""
        if self._seen is not None:
            self._seen.setdefault(entry, None)

    def agree(self) -> None:
        """At the end of the first synchronised backward (on every rank): the order
        from now on is the one backward produced, merged over the ranks."""
        if self._seen is None or self.exchange is None:
            return
        mine = [list(entry) for entry in self._seen]
        everyone = self.exchange(mine)
        self._seen = None
        valid = set(self.initial)
        orders = [[(u, s) for u, s in order if (u, s) in valid] for order in everyone]
        self.entries = merge_orders(orders, self.initial)

    def turns(self, entries: Callable[[Entry], bool]) -> Turns:
        """One backward's walk through the entries that `entries` keeps."""
        return Turns([entry for entry in self.entries if entries(entry)])


class Turns:
    """One backward's progress through the order: the entries sent, those waiting."""

    def __init__(self, entries: list[Entry]):
        self.entries = entries
        self._position = {entry: i for i, entry in enumerate(entries)}
        self._next = 0
        self._ready: dict[Entry, object] = {}
        self._reach = 0  # the ready entries from _next on end before this position

    def offer(self, entry: Entry, item: object, hold: bool = False) -> list[tuple[Entry, object]]:
        """`entry` is ready (with `item`): the entries whose turn has come, in order (an
        entry whose turn passed already, ready a second time, goes out at once). With
        `hold`, none: every entry waits for `release` or `rest`."""
        if self._position[entry] < self._next:
            return [(entry, item)]
        self._ready[entry] = item
        return [] if hold else self.release(len(self.entries))

    def will_miss(self, entry: Entry) -> None:
        """This rank will have no gradient for `entry` in this backward (its unit was not
        run): its turn needs no waiting."""
        if self._position[entry] >= self._next:
            self._ready.setdefault(entry, MISSING)

    def miss_the_rest(self) -> None:
        """This rank's backward is over: every entry not ready now will get no gradient
        here (what others release, this rank sends as `MISSING`)."""
        for entry in self.entries[self._next :]:
            self._ready.setdefault(entry, MISSING)

    def release(self, until: int) -> list[tuple[Entry, object]]:
        """The ready entries whose turn has come, in order, up to position `until`."""
        due = []
        end = min(until, len(self.entries))
        while self._next < end and self.entries[self._next] in self._ready:
            head = self.entries[self._next]
            due.append((head, self._ready.pop(head)))
            self._next += 1
        return due

    def reachable(self) -> int:
        """How far this rank could send in order now: the position of its first entry not
        yet ready."""
        self._reach = max(self._reach, self._next)
        while self._reach < len(self.entries) and self.entries[self._reach] in self._ready:
            self._reach += 1
        return self._reach

    def rest(self) -> list[tuple[Entry, object]]:
        """The end of backward: every entry not yet sent, in order, with its item or
        `MISSING`."""
        left = [(e, self._ready.pop(e, MISSING)) for e in self.entries[self._next :]]
        self._next = len(self.entries)
        return left

    def waiting(self) -> list[object]:
        """The items ready and waiting for their turn."""
        return list(self._ready.values())
