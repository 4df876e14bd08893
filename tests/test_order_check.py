"""Stage 3's module-order check (`zero_strategy/units/order_check.py`) on a chain of blocks.

A path that leaves the recorded order, on every rank alike or on one rank alone, in
forward or in backward, trains as one process does (the ranks take part in each other's
gathers, and the reductions wait for the end of backward); once the order is recorded,
every gather's check was announced ahead (no gather waits on its own check); an evaluation
forward follows the recorded order too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_world
from zero_strategy import ZeroConfig, ZeroEngine

BLOCKS = 4


class Chain(nn.Module):
    """Blocks in a ModuleList (a unit each) and a head in the root unit; `skip` names the
    blocks left out of this forward (LayerDrop)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(BLOCKS)])
        self.head = nn.Linear(16, 4)

    def forward(
        self, x: torch.Tensor, skip: tuple[int, ...] = (), detach: int | None = None
    ) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i not in skip:
                x = torch.tanh(block(x))
            if i == detach:  # backward stops here: it never reaches the blocks before
                x = x.detach()
        return self.head(x).pow(2).mean()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 16, generator=torch.Generator().manual_seed(10 * step + rank))


def _skips(step: int, rank: int, dropped: int, diverge: bool) -> tuple[int, ...]:
    """Step 2 drops block `dropped`: on every rank alike, or (diverge) on rank 1 only."""
    if step != 2 or (diverge and rank != 1):
        return ()
    return (dropped,)


def _train(rank: int, world: int, prefetch_depth: int, dropped: int, diverge: bool = False):
    model = Chain()
    config = ZeroConfig(stage=3, prefetch_depth=prefetch_depth, collective_timeout=20.0)
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    for step in range(4):
        skip = _skips(step, rank, dropped, diverge)
        engine.backward(engine(_batch(step, rank), skip=skip))
        engine.step()
        engine.zero_grad()
    state = {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    engine.close()
    return state


def _reference(world: int, dropped: int, diverge: bool = False) -> dict[str, torch.Tensor]:
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        for rank in range(world):
            skip = _skips(step, rank, dropped, diverge)
            (model(_batch(step, rank), skip=skip) / world).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("prefetch_depth", [0, 1, 2])
def test_a_step_that_drops_a_block_on_every_rank_trains_as_one_process(prefetch_depth):
    """LayerDrop with a seed shared by every rank: the path leaves the recorded order on
    every rank alike (the prefetch already gathered the dropped block, unused)."""
    ref = _reference(2, 2)
    for state in run_world(_train, 2, prefetch_depth, 2):
        for name, value in ref.items():
            torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("prefetch_depth", [0, 1, 2])
@pytest.mark.parametrize("dropped", range(BLOCKS))
def test_a_rank_that_drops_a_block_alone_trains_as_one_process(dropped, prefetch_depth):
    """Rank 1 drops one block on step 2, after the order is recorded; rank 0 runs it.
    Rank 1 takes part in the block's gathers and sends no gradient for it: the step is
    one process's over both batches."""
    ref = _reference(2, dropped, diverge=True)
    for state in run_world(_train, 2, prefetch_depth, dropped, True, timeout=120):
        for name, value in ref.items():
            torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)


def _detach_on_one_rank(rank: int, world: int, detached: int, prefetch_depth: int):
    model = Chain()
    config = ZeroConfig(stage=3, prefetch_depth=prefetch_depth, collective_timeout=60.0)
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    for step in range(3):
        detach = detached if step == 2 and rank == 1 else None
        engine.backward(engine(_batch(step, rank), detach=detach))
        engine.step()
        engine.zero_grad()
    state = {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    engine.close()
    return state


@pytest.mark.parametrize("prefetch_depth", [0, 1, 2])
@pytest.mark.parametrize("detached", [0, 2])
def test_a_rank_whose_backward_stops_early_trains_as_one_process(detached, prefetch_depth):
    """Rank 1's forward runs every block as rank 0's does, but its backward never reaches
    the blocks up to `detached`: it ends its backward early and takes part in rank 0's
    backward gathers until rank 0's ends; its reductions of those blocks carry no
    gradient, never another block's (same-sized) one."""
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        for rank in range(2):
            detach = detached if step == 2 and rank == 1 else None
            (model(_batch(step, rank), detach=detach) / 2).backward()
        opt.step()
        opt.zero_grad()
    results = run_world(_detach_on_one_rank, 2, detached, prefetch_depth, timeout=180)
    for state in results:
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)


def _evaluate_alone_with_every_unit_kept(rank: int, world: int):
    model = Chain()
    config = ZeroConfig(stage=3, persistence_threshold=10**6, collective_timeout=20.0)
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    for step in range(4):
        engine.backward(engine(_batch(step, rank)))
        engine.step()
        engine.zero_grad()
        if rank == 0:  # no unit is ever gathered again: an evaluation is local
            with torch.no_grad():
                for _ in range(50):
                    engine(_batch(100 + step, rank))
    state = {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    engine.close()
    return state


def test_an_evaluation_on_one_rank_alone_is_local_when_every_unit_stays_gathered():
    """With every unit persistent, an evaluation forward makes no collective, so rank 0
    may run one alone (many, here) between steps: training is unchanged, and no check
    is waiting on the other rank."""
    ref = _reference(2, dropped=-1)  # no block dropped
    for state in run_world(_evaluate_alone_with_every_unit_kept, 2, timeout=120):
        for name, value in ref.items():
            torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)


def _unannounced_per_step(rank: int, world: int, prefetch_depth: int, evaluate: bool):
    model = Chain()
    config = ZeroConfig(stage=3, prefetch_depth=prefetch_depth)
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    check = engine.gather.order_check
    counts = []
    for step in range(4):
        before = check.unannounced
        engine.backward(engine(_batch(step, rank)))
        engine.step()
        engine.zero_grad()
        if evaluate:
            with torch.no_grad():
                engine(_batch(step + 10, rank))
        counts.append(check.unannounced - before)
    engine.close()
    return counts


@pytest.mark.parametrize("prefetch_depth", [0, 1, 2])
@pytest.mark.parametrize("evaluate", [False, True])
def test_once_the_order_is_recorded_every_gather_is_announced_ahead(prefetch_depth, evaluate):
    """The first step records the module order, and each of its gathers is checked at once
    (every rank meets there). From the second step on, every gather, training or
    evaluation, was announced a unit early: no rank waits for the others at a unit."""
    for counts in run_world(_unannounced_per_step, 2, prefetch_depth, evaluate):
        assert counts[0] >= BLOCKS
        assert counts[1:] == [0, 0, 0], counts


def _evaluate_between_steps(rank: int, world: int):
    model = Chain()
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=3))
    for step in range(2):
        engine.backward(engine(_batch(step, rank)))
        engine.step()
        engine.zero_grad()
    engine.reset_comm_report()
    with torch.no_grad():
        engine(_batch(9, rank))
    gathered = sum(
        counts["bytes"]
        for kind, counts in engine.comm_report().items()
        if kind in ("broadcast", "all_gather")
    )
    padded = sum(4 * unit.layout.padded_numel for unit in engine.units)
    engine.backward(engine(_batch(2, rank)))  # training goes on after it
    engine.step()
    engine.close()
    return gathered, padded


def test_an_evaluation_forward_gathers_each_unit_once():
    """An evaluation forward follows the recorded order too: each unit is gathered once,
    the next one prefetched (it used to re-gather the first block at every block)."""
    for gathered, padded in run_world(_evaluate_between_steps, 2):
        assert gathered == padded
