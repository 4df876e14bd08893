"""Ranks that take different module paths under stage 3 train on; what cannot be
reconciled (a state_dict on one rank only) is an error naming each rank's module, and
without the order check nothing hangs either."""

from __future__ import annotations

import torch
from torch import nn

from distributed import run_world
from zero_strategy import ZeroConfig, ZeroEngine


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.heads = nn.ModuleList([nn.Linear(8, 4), nn.Linear(8, 6)])

    def forward(self, x: torch.Tensor, head: int) -> torch.Tensor:
        return self.heads[head](self.trunk(x)).sum()


def _divergent_step(rank: int, world: int, verify: bool, timeout: float):
    torch.manual_seed(0)
    model = TwoHeads()
    cfg = ZeroConfig(stage=3, verify_module_order=verify, collective_timeout=timeout)
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    # Step 1: same path everywhere.
    engine.backward(engine(torch.ones(2, 8), head=0))
    engine.step()
    engine.zero_grad()
    # Step 2: rank 1 takes the other head.
    engine.backward(engine(torch.ones(2, 8), head=rank % 2))
    engine.step()
    state = {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    engine.close()
    return state


def test_ranks_that_run_different_heads_train_as_one_process():
    torch.manual_seed(0)
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 8), head=0).backward()
    optimizer.step()
    optimizer.zero_grad()
    for rank in range(2):
        (model(torch.ones(2, 8), head=rank) / 2).backward()
    optimizer.step()
    for state in run_world(_divergent_step, 2, True, 30.0, timeout=60):
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_without_the_check_nothing_hangs_either():
    """With the check off, gloo meets mismatched collectives: the collective timeout (or
    gloo's own size check, which aborts the process) ends every rank; none hangs."""
    results = run_world(_divergent_step, 2, False, 5.0, expect_errors=True, timeout=90)
    assert all(status in ("error", "died") for status, _ in results), results


def _state_dict_on_rank0_only(rank: int, world: int):
    torch.manual_seed(0)
    model = TwoHeads()
    cfg = ZeroConfig(stage=3, unit_module_classes=["Linear"], collective_timeout=30.0)
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    engine.backward(engine(torch.ones(2, 8), head=0))
    engine.step()
    if rank == 0:
        model.state_dict()  # the usual mistake: "save on the main process"
    engine.backward(engine(torch.ones(2, 8), head=0))
    engine.step()
    return "finished"


def test_state_dict_on_one_rank_is_an_error_that_names_the_fix():
    """At stage 3 state_dict() gathers, so it is collective; rank 0 calling it alone meets
    rank 1's next forward gather, and the order check names both and the fix."""
    results = run_world(_state_dict_on_rank0_only, 2, expect_errors=True, timeout=60)
    for status, message in results:
        assert status == "error"
        assert "rank 0: state_dict of module" in message
        assert "rank 1: forward of module" in message
        assert "every rank must call them" in message
