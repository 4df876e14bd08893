"""Stages 2-3 on gloo send each parameter's gradient as autograd produced it. Two ways that
could go wrong, each against a single process doing the same arithmetic:

- ranks choosing differently between that and the unit buffers (a unit that got local
  sums under no_sync() on one rank only) would pair mismatched collectives;
- dividing or reducing autograd's own tensor in place would corrupt a gradient backward
  still has to read, when .grad is a view of it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_world
from zero_strategy import ZeroConfig, ZeroEngine


class Branchy(nn.Module):
    """Two units in a ModuleList and a head; the second unit is used only when asked."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_second: bool) -> torch.Tensor:
        h = torch.tanh(self.blocks[0](x))
        if use_second:
            h = torch.tanh(self.blocks[1](h))
        return self.head(h).pow(2).mean()


def _data(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(
        3, 8, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    )


def _uses_second(micro: int, rank: int) -> bool:
    return micro == 1 or rank == 0  # the no_sync micro-batch uses it on rank 0 only


def _train_branchy(rank: int, world: int, emulate: bool) -> dict[str, torch.Tensor]:
    model = Branchy()
    # Buckets of one Linear each (72 elements): the second block is a unit of its own.
    config = ZeroConfig(stage=2, bucket_size=72, reduce_scatter_via_all_reduce=emulate)
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    for step in range(3):
        with engine.no_sync():
            engine.backward(engine(_data(step, 0, rank), _uses_second(0, rank)))
        engine.backward(engine(_data(step, 1, rank), _uses_second(1, rank)))
        engine.step()
        engine.zero_grad()
    return {k: v.detach().clone() for k, v in engine.full_state_dict(rank0_only=False).items()}


def _reference_branchy(world: int) -> dict[str, torch.Tensor]:
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        for rank in range(world):
            for micro in range(2):
                (model(_data(step, micro, rank), _uses_second(micro, rank)) / world).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("emulate", [True, False])
def test_a_unit_with_local_sums_on_one_rank_only(emulate):
    """Rank 0's no_sync micro-batch reaches the second block, rank 1's does not: the
    synchronised backward after it must reduce that unit the same way on both ranks."""
    ref = _reference_branchy(2)
    for state in run_world(_train_branchy, 2, emulate):
        for name, value in ref.items():
            torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)


class AliasedGrad(nn.Module):
    """`h + w.unsqueeze(0)` at batch 1: autograd hands w a view of the sum's gradient as
    its .grad, and backward reads that same gradient afterwards to reach `lin`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) + self.w.unsqueeze(0)).pow(2).sum()


def _x(rank: int) -> torch.Tensor:
    return torch.randn(1, 8, generator=torch.Generator().manual_seed(7 + rank))


def _train_aliased(rank: int, world: int, stage: int) -> dict[str, torch.Tensor]:
    model = AliasedGrad()
    engine = ZeroEngine(
        model, torch.optim.SGD(model.parameters(), lr=0.01), ZeroConfig(stage=stage)
    )
    for _ in range(2):
        engine.backward(engine(_x(rank)))
        engine.step()
        engine.zero_grad()
    return {k: v.detach().clone() for k, v in engine.full_state_dict(rank0_only=False).items()}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_gradient_that_is_a_view_of_one_backward_still_needs(stage):
    model = AliasedGrad()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        for rank in range(2):
            (model(_x(rank)) / 2).backward()
        opt.step()
        opt.zero_grad()
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for state in run_world(_train_aliased, 2, stage):
        for name, value in ref.items():
            torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)


class _FailOnce(torch.autograd.Function):
    """Identity whose first backward raises (an OOM in the middle of a backward)."""

    armed = True

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("injected failure half way through backward")
        return grad


def _train_after_a_failed_backward(rank: int, world: int, stage: int, fail: bool):
    _FailOnce.armed = fail
    model = Branchy()
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=stage))
    original = model.blocks[1].forward
    model.blocks[1].forward = lambda x: original(_FailOnce.apply(x))
    if fail:  # the head's gradients are sent before the failure reaches the blocks
        with pytest.raises(RuntimeError, match="injected"):
            engine.backward(engine(_data(9, 0, rank), True))
        engine.zero_grad()
    gathered_after_backward = []
    for step in range(2):
        engine.backward(engine(_data(step, 1, rank), True))
        gathered_after_backward.append(engine.memory_report()["gathered_parameters"])
        engine.step()
        engine.zero_grad()
    state = {k: v.detach().clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    return state, gathered_after_backward


@pytest.mark.parametrize("stage", [2, 3])
def test_training_goes_on_after_a_backward_that_raised(stage):
    """zero_grad() after the failure finishes what was sent and forgets that backward:
    the next backwards end as usual (stage 3 releases every gathered unit at the end of
    backward) and the steps equal a run that never failed."""
    clean, _ = run_world(_train_after_a_failed_backward, 2, stage, False)[0]
    for state, gathered in run_world(_train_after_a_failed_backward, 2, stage, True):
        assert gathered == [0, 0]
        for name, value in clean.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


class SmallAroundLarge(nn.Module):
    """One unit whose small parameters lie on both sides of a large one (over
    `SMALL_GRAD_BYTES`), and whose shard boundary on 2 ranks falls inside the large one:
    the packed bucket holds two runs of the flat layout, one on each rank's side."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.first = nn.Linear(16, 16)
        self.wide = nn.Linear(16, 5000)  # its weight: 80,000 elements, sent alone
        self.last = nn.Linear(5000, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.wide(torch.tanh(self.first(x))))).pow(2).mean()


def _train_small_around_large(rank: int, world: int, native: bool):
    model = SmallAroundLarge()
    config = ZeroConfig(stage=2, reduce_scatter_via_all_reduce=False if native else None)
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    calls = []
    for step in range(3):
        engine.reset_comm_report()
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(engine(x))
        calls.append(engine.comm_report()["reduce_scatter"]["calls"])
        engine.step()
        engine.zero_grad()
    state = {k: v.detach().clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    (unit,) = engine.units
    boundary = unit.layout.shard_numel
    slots = {s.name: (s.offset, s.end) for s in unit.layout.slots}
    engine.close()
    return state, calls, boundary, slots


def test_small_gradients_are_packed_around_a_large_one():
    """gloo's pairwise sends: the large weight goes alone, the five small parameters as one
    bucket of two runs, split between the ranks at the shard boundary. They sum the same
    two numbers per element as one reduce-scatter of the unit's buffer, so the training
    is bitwise the same."""
    buffered, _, _, _ = run_world(_train_small_around_large, 2, True)[0]
    state, calls, boundary, slots = run_world(_train_small_around_large, 2, False)[0]
    lo, hi = slots["wide.weight"]
    assert lo < boundary < hi  # each rank's side of the bucket is one of its runs
    assert calls == [2, 2, 2]  # wide.weight alone, then the bucket
    for name, value in buffered.items():
        assert torch.equal(state[name], value), name
