"""Expert-parallel MoE layers, sharded by ZeRO over their expert-data-parallel groups:
the same training as one process holding every expert."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from distributed import run_world
from examples.gpt import GPT, GPTConfig
from training import global_batch, local_batch, make_optimizer, rel_l2
from zero_strategy import ZeroConfig, ZeroEngine
from zero_strategy.moe import MoE

WORLD, STEPS = 4, 6
MOE = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, n_experts=4)


def moe_model(ep_size: int) -> GPT:
    torch.manual_seed(0)
    return GPT(replace(MOE, ep_size=ep_size))


@pytest.fixture(scope="module")
def reference():
    """One process, every expert: each step averages the losses of the four ranks' local
    batches (what data parallelism optimises; the router's balancing loss is per batch)."""
    model = moe_model(1)
    opt = make_optimizer(model)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, 0, MOE)
        per = x.shape[0] // WORLD
        loss = sum(
            model(x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]) for r in range(WORLD)
        )
        loss = loss / WORLD
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank: int, world: int, ep_size: int, stage: int, **config):
    model = moe_model(ep_size)
    engine = ZeroEngine(model, make_optimizer(model), ZeroConfig(stage=stage, **config))
    losses = []
    for step in range(STEPS):
        x, y = local_batch(step, 0, rank, world, MOE)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    state = engine.full_state_dict()
    engine.close()
    return losses, state if rank == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_expert_parallel_matches_one_process(ep_size, stage, reference):
    ref_losses, ref_state = reference
    losses, state = run_world(_train, WORLD, ep_size, stage)[0]
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"
    assert state.keys() == ref_state.keys()
    assert rel_l2(state, ref_state) <= 1e-5


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="num_experts=6 must be a positive multiple of ep_size=4"):
        MoE(8, torch.nn.Linear(8, 8), num_experts=6, ep_size=4)
    with pytest.raises(ValueError, match="k=5 must be between 1 and num_experts=4"):
        MoE(8, torch.nn.Linear(8, 8), num_experts=4, k=5)
    moe = MoE(8, torch.nn.Linear(8, 16), num_experts=2)
    with pytest.raises(ValueError, match="must return its input's shape"):
        moe(torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="no expert-parallel group"):
        MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=2)(torch.randn(3, 8))
