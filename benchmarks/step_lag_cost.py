"""What stepping each parameter with its own count costs (`optim/step_lag.py`).

A parameter no rank gave a gradient on some step is behind its param group's count from
then on, and every later step of its range is taken twice: with the slice, then alone
with its own count, its values and state copied aside meanwhile. This times
`engine.step()` on a stack of 8 square blocks (33.6M parameters) and a head, 2 gloo
ranks, AdamW, at stages 1-3, in two runs side by side:

- "in step": every block is used on every step (no lag);
- "lagging": every block is dropped on the first step (as LayerDrop does, alike on every
  rank), then used on every step: each block's range is stepped again on every step.

The ratio lagging / in step is the cost, on each rank; the median over the steps after
the first two, over rounds that alternate the two runs (the machine is noisy). DDP's own
`optimizer.step()` (torch's AdamW over the whole model, as one process steps it) is
timed in the same rounds for scale.

    PYTHONPATH=. python benchmarks/step_lag_cost.py --steps 8 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.distributed import run_world

WIDTH, BLOCKS = 2048, 8


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor, drop_all: bool) -> torch.Tensor:
        for block in self.blocks:
            if not drop_all:
                x = torch.tanh(block(x))
        return self.head(x).pow(2).mean()


def _step_times(rank: int, stage: int | None, lagging: bool, steps: int) -> list[float]:
    from zero_strategy import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    model = Stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if stage is None:
        runner = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    else:
        runner = ZeroEngine(model, optimizer, ZeroConfig(stage=stage))
    times = []
    for step in range(steps):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = runner(x, lagging and step == 0)
        start = None
        if stage is None:
            loss.backward()
            start = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
        else:
            runner.backward(loss)
            start = time.perf_counter()
            runner.step()
            runner.zero_grad()
        times.append(time.perf_counter() - start)
    if stage is not None:
        runner.close()
    return times[2:]


def _round(rank: int, world: int, stages: list[int], steps: int, order: int):
    torch.set_num_threads(1)
    runs = [(stage, lagging) for stage in stages for lagging in (False, True)]
    runs.append((None, False))
    if order % 2:
        runs.reverse()
    return {
        f"{stage}-{lagging}": statistics.median(_step_times(rank, stage, lagging, steps))
        for stage, lagging in runs
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    rounds = [
        run_world(_round, 2, args.stages, args.steps, r, timeout=1800) for r in range(args.rounds)
    ]
    print(f"{BLOCKS} blocks of {WIDTH}x{WIDTH}, 2 gloo ranks, AdamW; median step ms, rank 0/1")
    print("| stage | in step (ms) | lagging (ms) | lagging / in step | DDP's step (ms) |")
    print("|---|---|---|---|---|")
    for stage in args.stages:
        cells = []
        for key in (f"{stage}-False", f"{stage}-True", "None-False"):
            per_rank = [statistics.median(r[rank][key] for r in rounds) for rank in range(2)]
            cells.append(per_rank)
        ratio = [
            statistics.median(r[rank][f"{stage}-True"] / r[rank][f"{stage}-False"] for r in rounds)
            for rank in range(2)
        ]
        fmt = " / ".join
        print(
            f"| {stage} | {fmt(f'{t * 1e3:.1f}' for t in cells[0])} "
            f"| {fmt(f'{t * 1e3:.1f}' for t in cells[1])} "
            f"| {fmt(f'{x:.2f}x' for x in ratio)} "
            f"| {fmt(f'{t * 1e3:.1f}' for t in cells[2])} |"
        )


if __name__ == "__main__":
    main()
