"""The reduction order every rank agrees on (`zero_strategy/units/reduction_order.py`)."""

from __future__ import annotations

from zero_strategy.units.reduction_order import MISSING, ReductionOrder, Turns, merge_orders


def test_the_merge_keeps_rank_0s_order_and_places_what_others_saw_after_its_predecessor():
    everything = [(u, 0) for u in (5, 4, 3, 2, 1, 0)]
    rank0 = [(5, 0), (4, 0), (2, 0), (0, 0)]  # skipped unit 3
    rank1 = [(5, 0), (3, 0), (2, 0), (0, 0)]  # skipped unit 4
    merged = merge_orders([rank0, rank1], everything)
    assert merged == [(5, 0), (4, 0), (3, 0), (2, 0), (0, 0), (1, 0)]
    # The same inputs give the same order (every rank computes it for itself).
    assert merge_orders([rank0, rank1], everything) == merged
    # An entry only a later rank saw first goes to the front.
    assert merge_orders([[(1, 0)], [(0, 0), (1, 0)]], [(1, 0), (0, 0)]) == [(0, 0), (1, 0)]


def test_before_agreement_the_order_is_the_layout_reversed_then_what_backward_produced():
    order = ReductionOrder([[True, False], [True, True]], exchange=lambda mine: [mine, mine])
    assert order.entries == [(1, 1), (1, 0), (0, 0)]
    for entry in [(0, 0), (1, 0), (1, 1)]:
        order.saw(entry)
    order.saw((0, 0))  # a second gradient of the same parameter keeps its first place
    order.agree()
    assert order.agreed
    assert order.entries == [(0, 0), (1, 0), (1, 1)]
    order.saw((1, 1))  # recorded no more
    assert order.entries == [(0, 0), (1, 0), (1, 1)]


def test_a_single_process_never_exchanges():
    order = ReductionOrder([[True]], exchange=None)
    order.saw((0, 0))
    order.agree()
    assert order.entries == [(0, 0)]


def test_turns_send_in_order_hold_what_is_early_and_flush_the_rest_as_missing():
    turns = Turns([(2, 0), (1, 0), (0, 0)])
    assert turns.offer((1, 0), "b") == []  # early: waits for (2, 0)
    assert turns.waiting() == ["b"]
    assert turns.offer((2, 0), "a") == [((2, 0), "a"), ((1, 0), "b")]
    assert turns.offer((2, 0), "again") == [((2, 0), "again")]  # its turn passed: at once
    assert turns.rest() == [((0, 0), MISSING)]
    assert turns.rest() == []
