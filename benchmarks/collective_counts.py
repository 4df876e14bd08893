"""Per-step collective counts (calls, bytes per kind) of a 4-block chain at stages 1-3 on 2
gloo ranks, rank 0, three steps: run it on two commits and diff the output.

    PYTHONPATH=. python benchmarks/collective_counts.py
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from torch import nn

from distributed import run_world
from zero_strategy import ZeroConfig, ZeroEngine


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x).pow(2).mean()


def run(rank, world, stage):
    torch.manual_seed(0)
    m = Chain()
    e = ZeroEngine(m, torch.optim.SGD(m.parameters(), lr=0.1), ZeroConfig(stage=stage))
    out = []
    for _ in range(3):
        e.reset_comm_report()
        e.backward(e(torch.randn(8, 64)))
        e.step()
        e.zero_grad()
        out.append(json.dumps(e.comm_report(), sort_keys=True))
    e.close()
    return out


for stage in (1, 2, 3):
    print(stage, run_world(run, 2, stage)[0])
