"""Which gradients `plan_buckets` packs together: the rules every rank applies alike to
the same order, so that its packed reductions pair up."""

from __future__ import annotations

import torch

from zero_strategy.layout.partition import ParamSlot, UnitLayout
from zero_strategy.layout.shard_spec import ShardSpec
from zero_strategy.units.grad_buckets import BUCKET_BYTES, SMALL_GRAD_BYTES, plan_buckets


def _layout(index: int, numels: list[int]) -> UnitLayout:
    slots, offset = [], 0
    for i, numel in enumerate(numels):
        slots.append(ParamSlot(f"p{i}", (), torch.Size([numel]), torch.float32, offset, 0))
        offset += numel
    return UnitLayout(index, f"u{index}", slots, 2, ShardSpec.world(2))


def _groups(planned) -> list[tuple[int, tuple[int, ...]]]:
    return sorted({(b.unit_index, b.slots) for b in planned.values()})


SMALL = SMALL_GRAD_BYTES // 4  # elements of fp32
LARGE = SMALL + 1


def test_a_run_of_small_gradients_is_one_bucket_in_layout_order():
    layouts = [_layout(0, [10, LARGE, 20, 30])]
    order = [(0, 3), (0, 2), (0, 1), (0, 0)]  # backward: the layout reversed
    planned = plan_buckets(order, layouts, 4, lambda u: True)
    # The large gradient in between goes alone and does not end the bucket.
    assert _groups(planned) == [(0, (0, 2, 3))]
    bucket = planned[(0, 0)]
    assert bucket.starts == (0, 10, 30) and bucket.numel == 60
    # Two runs of the flat layout: p0, then p2 and p3 (adjacent, one run).
    assert bucket.segments == ((0, 10), (10 + LARGE, 50))


def test_another_unit_ends_a_bucket_and_a_bucket_of_one_is_none():
    layouts = [_layout(0, [10, 10]), _layout(1, [10, 10])]
    order = [(1, 1), (0, 1), (1, 0), (0, 0)]  # interleaved: no two alike in a row
    assert plan_buckets(order, layouts, 4, lambda u: True) == {}
    order = [(1, 1), (1, 0), (0, 1), (0, 0)]
    assert _groups(plan_buckets(order, layouts, 4, lambda u: True)) == [(0, (0, 1)), (1, (0, 1))]


def test_buckets_hold_at_most_bucket_bytes():
    assert BUCKET_BYTES == 4 * SMALL_GRAD_BYTES  # four of the largest small ones fill one
    layouts = [_layout(0, [SMALL] * 9)]
    order = [(0, s) for s in reversed(range(9))]
    assert _groups(plan_buckets(order, layouts, 4, lambda u: True)) == [
        (0, (1, 2, 3, 4)),
        (0, (5, 6, 7, 8)),
    ]  # the ninth, left alone, is sent alone


def test_units_reduced_whole_are_not_packed():
    layouts = [_layout(0, [10, 10]), _layout(1, [10, 10])]
    order = [(1, 1), (1, 0), (0, 1), (0, 0)]
    planned = plan_buckets(order, layouts, 4, lambda u: u == 0)
    assert _groups(planned) == [(0, (0, 1))]
