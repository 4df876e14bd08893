"""`engine.full_optimizer_state_dict()`: the optimizer's whole state in memory, equal to
torch's `state_dict()` of the same optimizer trained in one process (parameters numbered
as torch numbers them), at every stage; rank 0's alone unless asked otherwise."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from training import global_batch, local_batch, make_model, make_optimizer

STEPS = 2


def _reference_state() -> dict:
    model = make_model()
    opt = make_optimizer(model)
    for step in range(STEPS):
        x, y = global_batch(step, 0)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return opt.state_dict()


def _sharded_states(rank, world, stage):
    from zero_strategy import ZeroConfig, ZeroEngine

    model = make_model()
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage))
    for step in range(STEPS):
        engine.backward(engine(*local_batch(step, 0, rank, world)))
        engine.step()
        engine.zero_grad()
    engine.reset_comm_report()
    rank0 = engine.full_optimizer_state_dict()
    to_rank0 = engine.comm_report()
    engine.reset_comm_report()
    everyone = engine.full_optimizer_state_dict(rank0_only=False)
    to_everyone = engine.comm_report()
    engine.close()
    return rank0, everyone, _payload(to_rank0), _payload(to_everyone)


def _payload(report: dict) -> dict[str, int]:
    """Bytes per payload collective kind (control messages and the index left out)."""
    return {
        k: v["bytes"] for k, v in report.items() if k in ("reduce", "all_reduce") and v["bytes"]
    }


def _assert_equal_states(state: dict, ref: dict) -> None:
    assert state["param_groups"] == ref["param_groups"]  # hyperparameters, numbering
    assert state["state"].keys() == ref["state"].keys()
    for i, ref_moments in ref["state"].items():
        moments = state["state"][i]
        assert moments.keys() == ref_moments.keys()
        for key, ref_value in ref_moments.items():
            value = moments[key]
            assert value.dtype == ref_value.dtype and value.shape == ref_value.shape
            if key == "step":
                assert torch.equal(value, ref_value)
            else:  # gradients averaged over the ranks: float reordering only
                torch.testing.assert_close(value, ref_value, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_whole_optimizer_state_is_torchs_state_dict_of_one_process(stage):
    ref = _reference_state()
    (rank0, everyone0, comm0, _), (rank1, everyone1, _, comm_all) = run_world(
        _sharded_states, 2, stage
    )
    assert rank1 == {}
    # Rank 0 alone keeping it: each tensor reduced to it once (half an all-reduce).
    elementwise = sum(
        t.numel() * t.element_size()
        for s in ref["state"].values()
        for k, t in s.items()
        if k != "step"
    )
    assert comm0 == {"reduce": elementwise}
    assert comm_all == {"all_reduce": elementwise}
    for state in (rank0, everyone0, everyone1):
        _assert_equal_states(state, ref)
        assert all(t.device.type == "cpu" for s in state["state"].values() for t in s.values())


def _three_optimizers(rank, world, stage):
    """A parameter two optimizers step (the shared head), and a third optimizer after
    them: each optimizer's state is its own."""
    from zero_strategy import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    shared = list(model[2].parameters())
    opts = [
        torch.optim.Adam([*model[0].parameters(), *shared], lr=1e-2),
        torch.optim.Adam([*model[1].parameters(), *shared], lr=2e-2),
        torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9),
    ]
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    if world > 1:
        engine = ZeroEngine(model, opts, ZeroConfig(stage=stage))
        engine.backward(engine(inputs[rank * 4 : (rank + 1) * 4]).square().mean())
        for opt in opts:
            engine.step(opt)
        engine.zero_grad()
        try:
            engine.full_optimizer_state_dict()
        except ValueError as e:
            unnamed = str(e)
        states = [engine.full_optimizer_state_dict(opt) for opt in opts]
        engine.close()
        return unnamed, states
    model(inputs).square().mean().backward()
    for opt in opts:
        opt.step()
    return [opt.state_dict() for opt in opts]


@pytest.mark.parametrize("stage", [1, 3])
def test_each_of_several_optimizers_is_asked_for_by_name(stage):
    ref = _three_optimizers(0, 1, stage)
    (unnamed, states), _ = run_world(_three_optimizers, 2, stage)
    assert "name the one" in unnamed and "3 optimizers" in unnamed
    for state, ref_state in zip(states, ref):
        _assert_equal_states(state, ref_state)
